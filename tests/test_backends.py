"""Low-bit backends: int8 layers close to their float originals, every output row independent of the rows
computed with it (so greedy speculation equals plain decoding on each backend), sampling still lossless,
and the per-machine choices."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import ByteTokenizer, random_hf_weights, tiny_config
from stats import PASS_P, seeded

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.config import EngineConfig
from specdecode.executor import backends
from specdecode.executor.backends import build_quantized_model, quantize_weights, refine_for_model, resolve_quantization
from specdecode.executor.quant import BlockLinear, W8A16Linear, lowbit_kernel, quantize_rows, w8a16_supported
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model
from specdecode.verify.rejection_sampler import rejection_sample

needs_kernel = pytest.mark.skipif(lowbit_kernel() is None, reason="the low-bit kernel needs a C compiler")
needs_w8a16 = pytest.mark.skipif(not w8a16_supported("cpu"), reason="no weight-only int8 kernel in this build")
BACKENDS = [
    pytest.param("w8a8", marks=needs_kernel),
    pytest.param("w4a8-all", marks=needs_kernel),
    pytest.param("w8a16", marks=needs_w8a16),
]


def _quantized(quantization: str, seed: int = 0, **cfg_kwargs) -> LoadedModel:
    cfg = tiny_config(**cfg_kwargs)
    tensors = quantize_weights(random_hf_weights(cfg, seed).items(), quantization)
    model = build_quantized_model(cfg, tensors, quantization, "cpu")
    return LoadedModel(f"tiny-{quantization}-{seed}", model, ByteTokenizer(cfg.vocab_size), cfg)


def _verify_vs_one_by_one(model, vocab: int, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a `width`-token chunk after a 30-token prompt: one verify call, and decoded one at a time."""
    gen = torch.Generator().manual_seed(2)
    prompt, chunk = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, width)]
    outputs = []
    for pieces in ([chunk], [[t] for t in chunk]):
        runner = ModelRunner(model, 1, 30 + width + 1)
        slot = runner.allocate()
        runner.forward([slot], [prompt], "last")
        runner.commit(slot, len(prompt))
        logits = []
        for piece in pieces:
            logits.append(runner.forward([slot], [piece], "all"))
            runner.commit(slot, runner.length(slot) + len(piece))
        outputs.append(torch.cat(logits))
    return outputs[0], outputs[1]


# ---- the layers -------------------------------------------------------------------------------------------
def test_quantize_rows_round_trips_within_half_a_step():
    w = torch.randn(16, 64)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@needs_kernel
def test_w8a8_linear_is_close_to_the_float_linear_and_adds_its_bias():
    from specdecode.executor.formats import quantize_q8_0

    torch.manual_seed(0)
    w, b, x = torch.randn(96, 128) * 0.05, torch.randn(96), torch.randn(5, 128)
    layer = BlockLinear(quantize_q8_0(w), b)
    exact = F.linear(x, w, b)
    y = layer(x)
    assert not torch.equal(y, exact)  # it really is the quantized path
    assert (y - exact).norm() / exact.norm() < 0.01


@needs_w8a16
def test_w8a16_linear_is_close_to_the_float_linear():
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.05, torch.randn(3, 128)
    y = W8A16Linear(*quantize_rows(w, 127))(x.bfloat16()).float()
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.03


# ---- whole models on each backend ---------------------------------------------------------------------------
@pytest.mark.parametrize("quantization", BACKENDS)
def test_quantized_model_tracks_the_float_model(quantization):
    cfg = tiny_config()
    weights = random_hf_weights(cfg, seed=0)
    ref = build_model(cfg, weights, torch.float32, "cpu")
    quant = _quantized(quantization).model
    ids = list(range(1, 40))
    got, expected = (ModelRunner(m, 1, 64).forward([0], [ids], "all") for m in (quant, ref))
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree > (0.8 if quantization == "w4a8-all" else 0.9), agree  # w4a8-all: 4 bits, for drafts
    assert quant.weight_bytes() < ref.weight_bytes() / 2.5  # int8 against float32


@needs_kernel
def test_w8a8_verify_logits_are_bitwise_equal_to_decode_logits():
    model = _quantized("w8a8", hidden=256).model
    verified, one_by_one = _verify_vs_one_by_one(model, model.cfg.vocab_size)
    assert torch.equal(verified, one_by_one)


@needs_kernel
def test_the_longest_verify_call_is_bitwise_equal_to_decoding_one_token_at_a_time():
    """Suffix speculation verifies up to suffix_max_tokens drafts (+1) in one call."""
    model = _quantized("w8a8", hidden=256).model
    verified, one_by_one = _verify_vs_one_by_one(model, model.cfg.vocab_size, EngineConfig.suffix_max_tokens + 1)
    assert torch.equal(verified, one_by_one)


@needs_kernel
def test_verifying_long_drafts_by_the_prefill_path_breaks_bitwise_equality(monkeypatch):
    """The check above can fail: a call wider than the row-wise limit attends by one masked call."""
    monkeypatch.setattr(ModelRunner, "_rowwise_width", lambda self: 16)
    model = _quantized("w8a8", hidden=256).model
    verified, one_by_one = _verify_vs_one_by_one(model, model.cfg.vocab_size, EngineConfig.suffix_max_tokens + 1)
    assert not torch.equal(verified, one_by_one)


@needs_kernel
def test_an_activation_scale_shared_by_the_call_breaks_bitwise_equality(monkeypatch):
    """The same comparison finds differences when a layer's activations are scaled by one factor per call
    (the per-call activation scale of common int8 GEMMs) around the kernel."""
    forward = BlockLinear.forward

    def per_call_scale(self, x):
        c = x.abs().amax().clamp(min=1e-6)
        return forward(self, x / c) * c

    monkeypatch.setattr(BlockLinear, "forward", per_call_scale)
    model = _quantized("w8a8", hidden=256).model
    verified, one_by_one = _verify_vs_one_by_one(model, model.cfg.vocab_size)
    assert not torch.equal(verified, one_by_one)


PROMPTS = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7], [12, 12, 12, 30, 31, 32, 33, 34]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("quantization", BACKENDS)
def test_greedy_speculation_equals_plain_decoding_on_each_backend(quantization):
    target, draft = _quantized(quantization, seed=0), _quantized(quantization, seed=7, layers=1)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for proposer in (dict(draft=draft), dict(draft=target), dict(speculative_model="ngram")):
        # a fixed k drafts every step: the adaptive policy would rightly never draft with a self-draft
        llm = LLM(
            target=target,
            num_speculative_tokens=4,
            max_model_len=128,
            max_num_seqs=4,
            speculation_policy="fixed",
            **proposer,
        )
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        if proposer.get("draft") is target:  # a self-draft is accepted: the comparison covered verified tokens
            assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("quantization", BACKENDS)
def test_a_broken_verifier_is_caught_on_each_backend(quantization):
    target, draft = _quantized(quantization, seed=0), _quantized(quantization, seed=7, layers=1)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    broken = LLM(
        target=target,
        draft=draft,
        num_speculative_tokens=4,
        max_model_len=128,
        forced_accept=True,
        speculation_policy="fixed",
    )
    assert [o.outputs[0].token_ids for o in broken.generate(PROMPTS, GREEDY)] != expected


@pytest.mark.parametrize("quantization", BACKENDS)
def test_sampling_from_backend_distributions_is_lossless(quantization):
    """The target's and draft's real next-token distributions on this backend, through the rejection
    sampler: the emitted first token follows p (chi-square), not q."""
    from scipy.stats import chisquare

    target, draft = _quantized(quantization, seed=0).model, _quantized(quantization, seed=7, layers=1).model
    prompt = PROMPTS[0]
    p, q = (torch.softmax(ModelRunner(m, 1, 64).forward([0], [prompt], "last")[0] / 1.5, -1) for m in (target, draft))
    gen = seeded(0)
    n = 40_000
    drafts = torch.multinomial(q.expand(n, -1), 1, generator=gen)
    result = rejection_sample(drafts, [1] * n, p.expand(n, 2, -1).contiguous(), q.expand(n, 1, -1).contiguous(), gen)
    counts = torch.bincount(torch.tensor([t[0] for t in result.tokens]), minlength=len(p)).float()
    keep = p * n >= 5
    expected = p[keep] * n
    expected *= counts[keep].sum() / expected.sum()
    assert chisquare(counts[keep], expected).pvalue > PASS_P
    assert chisquare(counts[keep], (q[keep] / q[keep].sum()) * counts[keep].sum()).pvalue < 1e-6


# ---- per-machine choices --------------------------------------------------------------------------------------
def test_auto_takes_the_block_kernel_where_it_has_simd_and_float_elsewhere(monkeypatch):
    monkeypatch.delenv("SPECDECODE_KERNELS", raising=False)  # the scalar test stage sets it
    monkeypatch.setattr(backends, "lowbit_isa", lambda: 256)
    assert resolve_quantization("auto", "cpu") == "w4a8"
    assert resolve_quantization("auto", "cpu", draft=True) == "w4a8-all"
    assert resolve_quantization("auto", "cuda") == "none"
    with pytest.raises(SpecDecodeError, match="w4a8 runs on the CPU"):
        resolve_quantization("w4a8", "cuda")
    monkeypatch.setattr(backends, "lowbit_isa", lambda: 0)  # only the scalar path: float is faster
    assert resolve_quantization("auto", "cpu") == "none"
    assert resolve_quantization("w8a8", "cpu") == "w8a8"  # asked for by name: still served
    monkeypatch.setenv("SPECDECODE_KERNELS", "scalar")  # the scalar build chosen on purpose (tests, CI)
    assert resolve_quantization("auto", "cpu") == "w4a8"
    with pytest.raises(SpecDecodeError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", "cpu")


def test_auto_gives_a_small_target_two_activation_passes():
    """SmolLM2-135M's 106M layer parameters take w4a16 under auto; the Qwen pair's 358M and 1.3B keep w4a8;
    a backend asked for by name, and a draft's, stay as asked."""
    smollm2 = tiny_config("llama", hidden=576, intermediate=1536, layers=30)
    smollm2 = dataclasses.replace(smollm2, num_heads=9, num_kv_heads=3)
    qwen_05b = dataclasses.replace(tiny_config(hidden=896, intermediate=4864, layers=24), num_heads=14, num_kv_heads=2)
    assert smollm2.layer_parameters == 106_168_320 and qwen_05b.layer_parameters == 357_826_560
    assert refine_for_model("w4a8", smollm2, "auto") == "w4a16"
    assert refine_for_model("w4a8", qwen_05b, "auto") == "w4a8"
    assert refine_for_model("w4a8", smollm2, "w4a8") == "w4a8"
    assert refine_for_model("w4a8-all", smollm2, "auto") == "w4a8-all"
    assert refine_for_model("none", smollm2, "auto") == "none"


@needs_kernel
def test_restricting_a_quantized_draft_vocabulary_keeps_its_rows():
    model = _quantized("w8a8").model
    runner = ModelRunner(model, 1, 64)
    full = runner.forward([0], [[3, 4, 5]], "last")
    ids = torch.tensor([0, 5, 9, 63])
    model.restrict_vocab(ids)
    assert torch.equal(ModelRunner(model, 1, 64).forward([0], [[3, 4, 5]], "last"), full[:, ids])
    model.restrict_vocab(ids)  # the same rows again (another LLM sharing the model): nothing changes
    assert torch.equal(ModelRunner(model, 1, 64).forward([0], [[3, 4, 5]], "last"), full[:, ids])
    with pytest.raises(SpecDecodeError, match="another vocabulary subset"):  # the full head is gone
        model.restrict_vocab(torch.tensor([0, 5]))
