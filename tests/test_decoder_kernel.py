"""The one-call decoder (kernels/decoder.c): the module-by-module forward's bits for every kind of layer and
batch it takes, builds of it with a deliberate mistake failing that comparison, and the models it leaves alone."""

import ctypes
from importlib import resources

import pytest
import torch
from conftest import kernel_builds, random_hf_weights, tiny_config

from specdecode.errors import SpecDecodeError
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.backends import build_quantized_model, prepare_head, quantize_weights
from specdecode.executor.decoder import DecoderKernel, attach_decoder_kernel
from specdecode.executor.elementwise import attach_elementwise_kernels
from specdecode.executor.formats import quantize_4bit, quantize_q8_0
from specdecode.executor.kernels import bind, build, compiler, load
from specdecode.executor.quant import BlockLinear, ConcatLinear, lowbit_kernel
from specdecode.executor.runner import ModelRunner
from specdecode.models.draft_head import HeadSpec, build_head, target_fingerprint
from specdecode.models.runtime import ForwardBatch, build_model

pytestmark = pytest.mark.skipif(
    lowbit_kernel() is None or load("attention") is None or load("decoder") is None,
    reason="the decoder kernel and the kernels it calls need a C compiler",
)

GPT_OSS_ATTENTION = "attention sinks and an output bias (gpt-oss's attention)"

# Each variant exercises one thing a layer of the kernel may hold
VARIANTS = {
    "qkv bias, Q8_0": dict(arch="qwen2"),
    "q/k norms, float16 cache": dict(arch="qwen3", qk_norm=True, kv="float16"),
    "two activation passes (w4a16)": dict(arch="llama", quantization="w4a16"),
    "sliding layers with their own RoPE base": dict(
        arch="llama", sliding_window=5, sliding_layers=(1,), local_rope_theta=500.0
    ),
    "q/k/v in different formats": dict(arch="qwen2", mixed_formats=True),
    "sandwich norms and GeGLU": dict(
        arch="gemma3",
        quantization="w4a16",  # as Gemma 3 270M loads: under 200M layer parameters
        sandwich_norms=True,
        activation="gelu_tanh",
        qk_norm=True,
        sliding_window=5,
        sliding_layers=(0, 1),
        local_rope_theta=500.0,
    ),
    "mixture of experts": dict(arch="qwen3moe", num_experts=4, experts_per_token=2, qk_norm=True, dense_layers=(1,)),
    "a layer without RoPE (SmolLM3's NoPE)": dict(arch="smollm3", nope_layers=(1,)),
    GPT_OSS_ATTENTION: dict(arch="qwen2", attention_sinks=True, o_bias=True, sliding_window=5, sliding_layers=(0, 2)),
    "soft-capped scores (Gemma 2)": dict(
        arch="gemma2",
        sandwich_norms=True,
        activation="gelu_tanh",
        sliding_window=5,
        sliding_layers=(0, 2),
        attention_softcap=1.5,  # below these weights' scores: a cap left out changes the bits
        final_softcap=30.0,
    ),
}


def _model(arch="qwen2", quantization="w8a8", kv="float32", mixed_formats=False, **features):
    cfg = tiny_config(arch, layers=3, **features)
    weights = random_hf_weights(cfg, 0)
    model = build_quantized_model(cfg, quantize_weights(weights.items(), quantization), quantization, "cpu")
    if mixed_formats:  # a Q6_K v beside Q4_K q and k, as a Q4_K_M file has it: here Q4_K k between Q8_0 q and v
        for i, layer in enumerate(model.layers):
            parts = [weights[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
            blocks = [
                BlockLinear(quantize_q8_0(parts[0])),
                BlockLinear(quantize_4bit(parts[1])),
                BlockLinear(quantize_q8_0(parts[2])),
            ]
            layer.self_attn.qkv_proj = ConcatLinear(blocks, layer.self_attn.qkv_proj.bias)
    assert attach_attention_kernel(model, kv) and attach_elementwise_kernels(model)
    assert attach_decoder_kernel(model)
    return model


def _session(model, kernel) -> list[torch.Tensor]:
    """Logits of prompts of three lengths packed in one call, a decode step of all three, and a verify call (4, 1
    and 2 rows), then every layer's cache: the calls a serving engine makes."""
    model.layers_kernel = kernel
    runner = ModelRunner(model, 3, 64)
    slots = [runner.allocate() for _ in range(3)]
    outs = []
    for inputs, logits in (
        ([list(range(3, 12)), list(range(20, 26)), [7, 8]], "last"),
        ([[30], [31], [32]], "last"),
        ([[40, 41, 42, 43], [44], [45, 46]], "all"),
    ):
        outs.append(runner.forward(slots, inputs, logits))
        for slot, tokens in zip(slots, inputs):
            runner.commit(slot, runner.length(slot) + len(tokens))
    cache = runner._cache
    return outs + [torch.cat([k.flatten() for k in cache.k]), torch.cat([v.flatten() for v in cache.v])]


def _head_session(head, kernel) -> list[torch.Tensor]:
    """A draft head's calls: rows of three sequences packed, with the target's features beside the tokens."""
    head.layers_kernel = kernel
    runner = ModelRunner(head, 3, 64)
    slots = [runner.allocate() for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    outs = []
    for inputs in ([list(range(3, 12)), [7, 8], [9]], [[30], [31, 32, 33], [34]]):
        features = [torch.randn(len(t), head.cfg.hidden_size, generator=g) for t in inputs]
        outs.extend(runner.forward(slots, inputs, "all", hidden=True, features=features))
        for slot, tokens in zip(slots, inputs):
            runner.commit(slot, runner.length(slot) + len(tokens))
    return outs


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_call_gives_the_module_by_module_bits(variant):
    model = _model(**VARIANTS[variant])
    kernel = model.layers_kernel
    assert _same(_session(model, kernel), _session(model, None))


@pytest.mark.parametrize(
    "variant",
    ["q/k norms, float16 cache", "sandwich norms and GeGLU", "mixture of experts", "soft-capped scores (Gemma 2)"],
)
@pytest.mark.parametrize("isa", kernel_builds())
def test_one_call_gives_the_module_bits_on_every_build(isa, variant, monkeypatch):
    """With every kernel of one build (SPECDECODE_KERNELS): the decoder calls the builds the modules call."""
    monkeypatch.setenv("SPECDECODE_KERNELS", isa)
    model = _model(**VARIANTS[variant])
    assert model.layers[0].self_attn.rowwise_kernel.lib is load("attention", isa)
    assert _same(_session(model, model.layers_kernel), _session(model, None))


def test_a_draft_heads_layer_in_one_call_gives_the_module_bits():
    """The head's one layer starts the residual stream as a first layer does; its projections are Q8_0."""
    target = _model()
    spec = HeadSpec("tiny", target_fingerprint(target), 96, target.cfg.vocab_size)
    head = prepare_head(build_head(spec, None, target, torch.arange(target.cfg.vocab_size)))
    assert head.layers_kernel is not None
    assert _same(_head_session(head, head.layers_kernel), _head_session(head, None))


# A mistake in each thing the kernel does beyond calling other kernels: the bias added, the parts' columns placed,
# the residual stream carried, the window's RoPE table chosen, the sandwich norms' weights and order, the experts'
# input and routing.
MISTAKES = {
    "bias left out": ("y[(int64_t)r * p->out_features + c] += p->bias[c];", ";", "qkv bias, Q8_0"),
    "parts at one column": ("col += b[i].out_features, i++", "i++", "q/k/v in different formats"),
    "residual restarted each layer": ("if (l == 0) {", "if (1) {", "qkv bias, Q8_0"),
    "one RoPE table for all": ("t->cos[L->local_rope]", "t->cos[0]", "sliding layers with their own RoPE base"),
    "a NoPE layer rotated": ("t->sin[L->local_rope]", "t->sin[0]", "a layer without RoPE (SmolLM3's NoPE)"),
    "scores not soft-capped": ("L->window, L->softcap,", "L->window, 0.f,", "soft-capped scores (Gemma 2)"),
    "sinks left out": ("L->sinks, t->kcache[l]", "NULL, t->kcache[l]", GPT_OSS_ATTENTION),
    "pre-feedforward norm with the post-attention weights": (
        "L->pre_ff_norm, s->normed",
        "L->post_norm, s->normed",
        "sandwich norms and GeGLU",
    ),
    "MLP output not normed": (
        "return m->norm(s->mlp_out, L->post_ff_norm, x, n, hidden, L->eps, threads);",
        "memcpy(x, s->mlp_out, (size_t)n * hidden * sizeof(float)); return 0;",
        "sandwich norms and GeGLU",
    ),
    "experts read a stale buffer": ("&L->moe, s->normed,", "&L->moe, s->qkv,", "mixture of experts"),
    "router's normalisation flipped": ("e->router, e->normalize,", "e->router, !e->normalize,", "mixture of experts"),
}


@pytest.mark.skipif(compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_build_with_a_mistake_fails_the_comparison(mistake):
    right, wrong, variant = MISTAKES[mistake]
    source = resources.files("specdecode.executor.kernels").joinpath("decoder.c").read_text()
    assert right in source
    broken = bind(ctypes.CDLL(build("decoder", "native", compiler(), source.replace(right, wrong).encode())), "decoder")
    model = _model(**VARIANTS[variant])
    assert not _same(_session(model, DecoderKernel(broken)), _session(model, None))


def _move_and_zero_the_old_copies(layers) -> None:
    old = [t.detach() for t in (*layers.parameters(), *layers.buffers())]
    layers._apply(lambda t: t.clone())  # as huge pages move a draft head's own modules
    with torch.no_grad():
        for t in old:
            t.zero_()


def test_moved_weights_are_found_again():
    """The kernel takes the weights' new addresses, where one that kept the old ones (told nothing moved) computes
    from the zeros left there."""
    model = _model()
    kernel = model.layers_kernel
    before = _session(model, kernel)
    _move_and_zero_the_old_copies(model.layers)
    assert _same(_session(model, kernel), before)
    _move_and_zero_the_old_copies(model.layers)
    kernel._moves = [layer.moves for layer in model.layers]  # the addresses taken before this move, kept
    assert not _same(_session(model, kernel), before)


def test_two_caches_in_turn_are_each_read_and_written_at_their_own_addresses():
    """Two runners of one model (a server's replicas share weights) called in turn: the kernel follows the cache."""
    model = _model()

    def calls(kernel):
        model.layers_kernel = kernel
        runners = [ModelRunner(model, 1, 64), ModelRunner(model, 1, 64)]
        slots = [r.allocate() for r in runners]
        outs = []
        for tokens in ([3, 4, 5], [9, 8], [6], [7]):
            for runner, slot in zip(runners, slots):
                outs.append(runner.forward([slot], [tokens]))
                runner.commit(slot, runner.length(slot) + len(tokens))
                tokens = [t + 1 for t in tokens]
        return outs

    assert _same(calls(model.layers_kernel), calls(None))


def test_a_failing_step_is_named_with_its_layer():
    model = _model()
    cache = ModelRunner(model, 1, 64)._cache
    batch = ForwardBatch.build([3], [0], [2], 64, "cpu")  # slot 3 of a cache of one: the attention kernel refuses it
    with pytest.raises(SpecDecodeError, match="attention in layer 0 failed: a slot or position outside the KV cache"):
        model(torch.tensor([[1, 2]]), batch, cache)


def test_a_failing_experts_step_is_named_with_its_layer():
    model = _model(**VARIANTS["mixture of experts"])
    runner = ModelRunner(model, 1, 64)
    slot = runner.allocate()
    runner.forward([slot], [[1, 2]])  # describes the layers
    model.layers_kernel._layers[2].moe.passes = 3  # what lowbit_moe refuses
    with pytest.raises(SpecDecodeError, match="experts in layer 2 failed: activation passes other than 1 or 2"):
        runner.forward([slot], [[3]])


@pytest.mark.parametrize("variant", ["sandwich norms and GeGLU", "mixture of experts"])
def test_a_layer_the_kernel_would_compute_otherwise_stays_module_by_module(variant):
    """A norm of another epsilon (the kernel takes one per layer), or experts without their kernel (of mixed
    formats, say): the model keeps its module loop."""
    model = _model(**VARIANTS[variant])
    layer = model.layers[1]
    if variant == "mixture of experts":
        model.layers[0].mlp.kernel = None
    else:
        layer.post_feedforward_layernorm.eps *= 2
    model.layers_kernel = None
    assert not attach_decoder_kernel(model) and model.layers_kernel is None


def test_float_weights_stay_module_by_module():
    cfg = tiny_config()
    model = build_model(cfg, random_hf_weights(cfg, 0), torch.float32, "cpu")
    attach_attention_kernel(model)
    attach_elementwise_kernels(model)
    assert not attach_decoder_kernel(model)
