"""Shared fixtures: tiny random Llama/Qwen2 models with a byte-level tokenizer, for fast engine tests."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import sys
import threading
import time

import pytest

# Without a GPU, the GPU's Triton kernels run in Triton's interpreter, which is chosen before Triton is imported
# (torch's compiler imports it).
if os.environ.get("SPECDECODE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import uvicorn  # noqa: E402

from specdecode.config import ModelConfig  # noqa: E402
from specdecode.models.loader import LoadedModel  # noqa: E402
from specdecode.models.runtime import build_model  # noqa: E402

VOCAB = 64
# `SPECDECODE_TEST_DEVICE=cuda` builds the tiny models on the GPU, so the engine's correctness tests
# (greedy equality, distribution tests, rollback, their deliberately broken versions) run there unchanged.
DEVICE = os.environ.get("SPECDECODE_TEST_DEVICE", "cpu")
# How far a row's logprob may move when the same tokens are computed in another batch shape (a cached
# prompt's last token alone, say). The GGUF kernels are row-invariant, but the tiny float32 models' linear layers
# are torch's, whose CPU kernel for one row is another than for several (~4e-6 apart in a logit; logprobs were
# seen 1.6e-6 apart); CUDA's GEMM kernels change with the row count, in the last bits of float32.
SHAPE_ATOL = 1e-5 if DEVICE == "cpu" else 1e-4


# The real-model and Ray files are among the longest (minutes each): collected first and handed out in collection
# order (`--no-loadscope-reorder`), pytest-xdist starts them at once and the other processes work through the shorter
# files beside them, so that no process runs a long file alone at the end while the others idle.
LONG_RUNNING_MARKS = ("real_model", "ray")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not any(item.get_closest_marker(mark) for mark in LONG_RUNNING_MARKS))


def kernel_builds(amx_tiles: bool = False) -> list:
    """The instruction-set builds of the native kernels this CPU runs, as pytest params: its own, the
    AVX2 path (on x86 CPUs that have AVX2; an AVX-512 machine runs it too) and the portable scalar one;
    for a kernel with an AMX path (`amx_tiles`), also the AVX-512 VNNI path on CPUs that have AMX."""
    from specdecode.executor.cpu import cpu_flags

    flags = cpu_flags()
    amx, avx2 = {"amx_int8", "avx512_vnni"} <= flags, {"avx2", "fma"} <= flags
    return [
        "native",
        *(
            [
                pytest.param(
                    "avx512",
                    marks=pytest.mark.skipif(
                        not amx, reason="no AMX here: native is the AVX-512 (or AVX2) path, tested as such"
                    ),
                )
            ]
            if amx_tiles
            else []
        ),
        pytest.param(
            "avx2",
            marks=pytest.mark.skipif(
                not avx2, reason="this CPU has no AVX2/FMA: the AVX2 path is tested on CPUs that have it"
            ),
        ),
        "scalar",
    ]


class ByteTokenizer:
    """Token i <-> character chr(32 + i); the last id is EOS. Enough for engine tests."""

    def __init__(self, vocab: int = VOCAB):
        self.vocab = vocab
        self.eos_token_ids = frozenset({vocab - 1})
        self.special_ids = set(self.eos_token_ids)
        self.vocab_size = vocab

    def get_vocab(self) -> dict[str, int]:
        return {chr(32 + i): i for i in range(self.vocab)}

    def encode(self, text: str) -> list[int]:
        return [min(max(ord(ch) - 32, 0), self.vocab - 2) for ch in text]

    def encode_fragment(self, text: str) -> list[int]:
        return self.encode(text)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [chr(32 + i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **variables,
    ) -> str:
        """Each message as <role>content (a message ends where the next begins: the last one is left open), an
        assistant's calls as <tool_call> blocks, the tools and any other variables first, then <assistant> where a
        reply is asked for."""

        def calls(m):
            return "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls", []))

        shown = f"<tools>{json.dumps(tools)}</tools>" if tools else ""
        shown += "".join(f"<{name}={value}>" for name, value in sorted(variables.items()))
        text = shown + "".join(f"<{m['role']}>{m['content']}{calls(m)}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def with_chat_template(self, template: str, files: bool = True) -> "ByteTokenizer":
        """A twin rendering chats with the template (read and checked as the real tokenizer reads it) in Jinja's
        sandbox, as transformers renders templates."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        from specdecode.models.tokenizer import read_chat_template

        compiled = ImmutableSandboxedEnvironment().from_string(read_chat_template(template, files))
        twin = copy.copy(self)
        twin.apply_chat_template = lambda messages, tools=None, **options: compiled.render(
            messages=messages, tools=tools, **{"add_generation_prompt": True} | options
        )
        return twin


def with_mistake(module, old: str, new: str, tmp_path, monkeypatch):
    """A copy of one of the package's modules whose source says `new` where it says `old` (once), imported under a name
    of its own (registered, as its dataclasses look their module up) with its relative imports made absolute."""
    source = inspect.getsource(module)
    assert source.count(old) == 1
    package, name = module.__name__.rsplit(".", 1)
    source = source.replace(old, new).replace("from ..", "from specdecode.").replace("from .", f"from {package}.")
    path = tmp_path / f"broken_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    broken = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, broken)
    spec.loader.exec_module(broken)
    return broken


def cloned_cache(cache):
    """A KV cache sharing `cache`'s block table and layout, with copies of its entries: the same step run on both
    leaves each one's writes apart."""
    other = type(cache).__new__(type(cache))
    other.__dict__.update(cache.__dict__)
    other.k, other.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    return other


def tiny_config(
    arch: str = "qwen2",
    vocab: int = VOCAB,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int | None = None,
    max_position: int = 256,
    **features,
) -> ModelConfig:
    """features: ModelConfig's family fields (experts, windows, q/k norms...)."""
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position=max_position,
        qkv_bias=arch == "qwen2",
        tie_word_embeddings=False,
        **features,
    )


def random_hf_weights(cfg: ModelConfig, seed: int, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Random weights named like a Hugging Face checkpoint (every family's parts: q/k norms, sandwich norms,
    experts and their router, where the config has them)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    d, kv, hidden = cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head, cfg.hidden_size
    w = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, hidden) * 6,
        "model.norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(cfg.vocab_size, hidden) * 3,
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(cfg.num_heads * d, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv, hidden)
        if cfg.qkv_bias:
            for name, size in (("q", cfg.num_heads * d), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = rand(size)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = 1 + rand(d), 1 + rand(d)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, cfg.num_heads * d)
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = rand(hidden)
        if cfg.attention_sinks:  # as large as the scores: a sink left out changes every output
            w[p + "self_attn.sinks"] = rand(cfg.num_heads) * 10
        if cfg.is_sparse(i):
            w[p + "mlp.gate.weight"] = rand(cfg.num_experts, hidden) * 8
            if cfg.expert_selection_bias:
                w[p + "mlp.gate.selection_bias"] = rand(cfg.num_experts) * 2
            for e in range(cfg.num_experts):
                w.update(_mlp_weights(rand, f"{p}mlp.experts.{e}.", hidden, cfg.expert_size))
        else:
            w.update(_mlp_weights(rand, p + "mlp.", hidden, cfg.intermediate_size))
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.sandwich_norms else []
        for norm in norms:
            w[p + f"{norm}.weight"] = 1 + rand(hidden)
    return w


def _mlp_weights(rand, prefix: str, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        prefix + "gate_proj.weight": rand(inter, hidden),
        prefix + "up_proj.weight": rand(inter, hidden),
        prefix + "down_proj.weight": rand(hidden, inter),
    }


def tiny_model(seed: int = 0, arch: str = "qwen2", **cfg_kwargs) -> LoadedModel:
    cfg = tiny_config(arch, **cfg_kwargs)
    model = build_model(cfg, random_hf_weights(cfg, seed), torch.float32, DEVICE)
    return LoadedModel(f"tiny-{arch}-{seed}", model, ByteTokenizer(cfg.vocab_size), cfg)


def lowbit_tiny_model(hidden: int = 64):
    """A tiny model as GGUF files run on a CPU: Q8_0 linear layers by the low-bit kernel (each row of a call
    computed alone, by construction) and the attention kernel (each row over its own keys), so that one call packs
    rows of any lengths. (torch's float32 GEMM is not row-independent: on some CPUs, e.g. Ice Lake, it accumulates
    a row differently in a 1-row and a 4-row call.) Skips where the kernels do not build."""
    from specdecode.executor.attention import attach_attention_kernel
    from specdecode.executor.backends import build_quantized_model, quantize_weights
    from specdecode.executor.kernels import load
    from specdecode.executor.quant import lowbit_kernel

    if lowbit_kernel() is None or load("attention") is None:
        pytest.skip("the low-bit and attention kernels need a C compiler")
    cfg = tiny_config(hidden=hidden)
    model = build_quantized_model(cfg, quantize_weights(random_hf_weights(cfg, 0).items(), "w8a8"), "w8a8", "cpu")
    assert attach_attention_kernel(model) or model.layers[0].self_attn.rowwise_kernel is not None
    return model


def make_head(target: LoadedModel, path, seed: int = 0, intermediate: int = 48) -> str:
    """An untrained draft head for `target`, saved at path; its speculative_model name."""
    from specdecode.models.draft_head import HeadSpec, build_head, save_head, target_fingerprint

    torch.manual_seed(seed)
    spec = HeadSpec(target.name, target_fingerprint(target.model), intermediate, target.config.vocab_size)
    save_head(build_head(spec, None, target.model, torch.arange(target.config.vocab_size)), spec, str(path))
    return f"head:{path}"


def run_as_one_batch(engine, prompt_ids: list[list[int]], params) -> tuple[list[list[int]], list[list[int]], int]:
    """Queue every prompt, step until all finish: (outputs, tokens drafted per sequence in each decoding step,
    sequence-steps drafted by prompt lookup)."""
    seqs = [engine.add_request(ids, params) for ids in prompt_ids]
    step_ks, lookup_drafts = [], 0
    while engine.has_unfinished():
        out = engine.step()
        if out.batch_size:  # not the step that only prefilled
            step_ks.append(list(out.draft_lengths))
        lookup_drafts += out.lookup_drafts
    return [s.output_ids for s in seqs], step_ks, lookup_drafts


def fixed_shapes_as_on_a_gpu(monkeypatch) -> None:
    """Fixed-shape forwards and chained drafting rounds, as on a GPU (without its kernels on a CPU: slow there)."""
    from specdecode.executor import runner as runner_module

    monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: True)
    if DEVICE == "cpu":
        for kernels in ("fuse_elementwise", "gpu_attention"):
            monkeypatch.setattr(runner_module, kernels, lambda model: None)


def near_target_draft() -> LoadedModel:
    """A draft close to tiny_model(seed=0) (its weights perturbed): it drafts what that target takes, often but not
    always."""
    draft = tiny_model(seed=0)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p) * 0.05)
    return draft


def priced_without_timing(policy, monkeypatch, batches: int) -> None:
    """The adaptive policy's costs fixed for up to `batches` sequences (a verified row nearly free, as the CPU's kernels
    make it; a draft model a fraction of a step) and its steps left untimed: what it chooses then depends on acceptance
    alone, not on how busy the machine is (beside other tests, measured costs kept drafts within k, or none at all)."""
    for batch in range(1, batches + 1):
        for tokens in range(batch, 20 * batch + 1):
            policy.costs.target.record(batch, tokens, 0.05 + 0.0005 * (tokens - batch))
        policy.costs.draft.record(batch, 0.03)
    observe = policy.observe_step

    def untimed(ks, target_seconds, draft_seconds, *args, **kwargs):
        observe(ks, target_seconds, None, *args, **{**kwargs, "untimed": True})

    monkeypatch.setattr(policy, "observe_step", untimed)


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def random_draft() -> LoadedModel:
    return tiny_model(seed=123, layers=1)


def wait_until(condition, what: str, timeout: float = 30.0, every: float = 0.01):
    """Poll `condition` until it holds (the state a test waits for, never a guessed pause); fails naming `what`
    past `timeout` seconds. Returns the condition's (true) value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(every)
    return value


class LocalServer:
    """A uvicorn server for an app, in a thread, on a free 127.0.0.1 port."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, "the server started")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ScriptedEngine:
    """What the HTTP layer needs of an engine, every request answered with the same pieces of text."""

    max_model_len, vocab_size, adapters, sampling_defaults = 2048, 100, [], {}

    def __init__(self, pieces: list[str], opens_thinking: bool = False):
        self.tokenizer, self.pieces, self.opens = ByteTokenizer(100), pieces, opens_thinking
        if opens_thinking:  # a template that ends the prompt inside the thinking, as DeepSeek-R1's does
            render = self.tokenizer.apply_chat_template
            self.tokenizer.apply_chat_template = lambda *a, **kw: render(*a, **kw) + "<think>\n"

    def submit(self, prompt_ids, params, session=None, streamed=False, tenant="", adapter=""):
        return params

    async def updates(self, handle, timeout=None):
        from specdecode.server.async_engine import Update

        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            yield Update(piece, last, "stop" if last else None, num_tokens=k + 1)

    async def metrics_text(self) -> bytes:
        return b""


def fixed_k_llm(target, draft=None, k: int = 3, **kw):
    """An engine that drafts k tokens every step (no adaptive policy, no confidence stop): for tests of the mechanics
    of a given k."""
    from specdecode import LLM

    kw.setdefault("speculation_policy", "fixed")
    kw.setdefault("draft_confidence", 0.0)
    return LLM(
        target=target,
        draft=draft,
        speculative_model=kw.pop("speculative_model", None),
        num_speculative_tokens=k,
        max_model_len=256,
        **kw,
    )


def json_writing_llm():
    """An engine on tiny models whose vocabulary (100) holds braces and quotes, so that JSON can be written: a draft
    model proposes 3 tokens every step."""
    from specdecode import LLM

    return LLM(
        target=tiny_model(seed=0, vocab=100, max_position=2048),
        draft=tiny_model(seed=5, vocab=100, layers=1, max_position=2048),
        num_speculative_tokens=3,
        max_model_len=2048,
        speculation_policy="fixed",
    )


def tiny_llm(seed: int = 0, draft_seed: int = 123, k: int = 3, max_num_seqs: int = 8, policy: str = "fixed"):
    """A whole engine on tiny models, built where it runs (e.g. inside a Ray Serve replica)."""
    from specdecode import LLM

    return LLM(
        target=tiny_model(seed=seed),
        draft=tiny_model(seed=draft_seed, layers=1),
        num_speculative_tokens=k,
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        speculation_policy=policy,
    )
