"""Low-bit backends: int8 layers close to their float originals, every output row independent of the rows
computed with it (so greedy speculation equals plain decoding on each backend), sampling still lossless,
and the per-machine choices."""
import pytest
import torch
import torch.nn.functional as F

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.executor import backends
from specdecode.executor.backends import build_quantized_model, quantize_weights, resolve_quantization
from specdecode.executor.quant import (Int8Embedding, W8A8Linear, W8A16Linear, quantize_rows, w8a8_supported,
                                       w8a16_supported)
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import build_model
from specdecode.verify.rejection_sampler import rejection_sample

from conftest import ByteTokenizer, random_hf_weights, tiny_config

needs_w8a8 = pytest.mark.skipif(not w8a8_supported(), reason="FBGEMM (x86 CPU builds of torch) is not available")
needs_w8a16 = pytest.mark.skipif(not w8a16_supported("cpu"), reason="no weight-only int8 kernel in this build")
BACKENDS = [pytest.param("w8a8", marks=needs_w8a8), pytest.param("w8a16", marks=needs_w8a16)]


def _quantized(quantization: str, seed: int = 0, **cfg_kwargs) -> LoadedModel:
    cfg = tiny_config(**cfg_kwargs)
    tensors = quantize_weights(random_hf_weights(cfg, seed).items(), backends.int8_weight_max())
    model = build_quantized_model(cfg, tensors, quantization, "cpu")
    return LoadedModel(f"tiny-{quantization}-{seed}", model, ByteTokenizer(cfg.vocab_size), cfg)


def _verify_vs_one_by_one(model, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 6-token chunk after a 30-token prompt: one verify call, and decoded one at a time."""
    gen = torch.Generator().manual_seed(2)
    prompt, chunk = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 6)]
    outputs = []
    for pieces in ([chunk], [[t] for t in chunk]):
        runner = ModelRunner(model, 1, 64)
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
    for qmax in (127, 63):
        q, scale = quantize_rows(w, qmax)
        assert q.dtype == torch.int8 and q.abs().max() <= qmax
        assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@needs_w8a8
def test_w8a8_linear_is_close_to_the_float_linear_and_adds_its_bias():
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 128) * 0.05, torch.randn(96), torch.randn(5, 128)
    layer = W8A8Linear(*quantize_rows(w, 127), b)
    exact = F.linear(x, w, b)
    y = layer(x)
    assert not torch.equal(y, exact)  # it really is the quantized path
    assert (y - exact).norm() / exact.norm() < 0.02


@needs_w8a8
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 17])
def test_w8a8_rows_do_not_depend_on_the_other_rows(rows):
    torch.manual_seed(rows)
    layer = W8A8Linear(*quantize_rows(torch.randn(200, 96) * 0.05, 127))
    x = torch.randn(rows, 96)
    x[0] *= 40  # one row with a much larger range must not change the others' quantization
    assert torch.equal(layer(x), torch.cat([layer(x[i:i + 1]) for i in range(rows)]))


@needs_w8a8
def test_per_call_activation_scale_breaks_row_independence():
    """FBGEMM's own dynamic linear quantizes all rows with one scale: the test above catches that."""
    torch.manual_seed(1)
    layer = W8A8Linear(*quantize_rows(torch.randn(200, 96) * 0.05, 127))
    x = torch.randn(5, 96)
    x[0] *= 40
    dynamic = torch.ops.quantized.linear_dynamic
    together = dynamic(x, layer.packed, False)
    alone = torch.cat([dynamic(x[i:i + 1], layer.packed, False) for i in range(5)])
    assert not torch.equal(together, alone)


@needs_w8a16
def test_w8a16_linear_is_close_to_the_float_linear():
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.05, torch.randn(3, 128)
    y = W8A16Linear(*quantize_rows(w, 127))(x.bfloat16()).float()
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 0.03


def test_int8_embedding_dequantizes_the_rows_it_reads():
    w = torch.randn(50, 16)
    q, scale = quantize_rows(w, 127)
    emb = Int8Embedding(q, scale, torch.float32)
    tokens = torch.tensor([[3, 49, 3]])
    torch.testing.assert_close(emb(tokens), (q.float() * scale[:, None])[tokens])


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
    assert agree > 0.9, agree
    assert quant.weight_bytes() < ref.weight_bytes() / 2.5  # int8 against float32


@needs_w8a8
def test_w8a8_verify_logits_are_bitwise_equal_to_decode_logits():
    model = _quantized("w8a8", hidden=256).model
    verified, one_by_one = _verify_vs_one_by_one(model, model.cfg.vocab_size)
    assert torch.equal(verified, one_by_one)


@needs_w8a8
def test_w8a8_with_a_per_call_activation_scale_breaks_bitwise_equality(monkeypatch):
    """The same comparison with FBGEMM's per-call activation scale finds differences."""
    monkeypatch.setattr(W8A8Linear, "forward", lambda self, x: torch.ops.quantized.linear_dynamic(
        x.reshape(-1, self.in_features), self.packed, False).reshape(*x.shape[:-1], self.out_features)
        + (0 if self.bias is None else self.bias))
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
        llm = LLM(target=target, num_speculative_tokens=4, max_model_len=128, max_num_seqs=4, **proposer)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.spec["num_accepted_tokens"] for o in outs) >= 0


@pytest.mark.parametrize("quantization", BACKENDS)
def test_a_broken_verifier_is_caught_on_each_backend(quantization):
    target, draft = _quantized(quantization, seed=0), _quantized(quantization, seed=7, layers=1)
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    broken = LLM(target=target, draft=draft, num_speculative_tokens=4, max_model_len=128, forced_accept=True,
                 speculation_policy="fixed")
    assert [o.outputs[0].token_ids for o in broken.generate(PROMPTS, GREEDY)] != expected


@pytest.mark.parametrize("quantization", BACKENDS)
def test_sampling_from_backend_distributions_is_lossless(quantization):
    """The target's and draft's real next-token distributions on this backend, through the rejection
    sampler: the emitted first token follows p (chi-square), not q."""
    from scipy.stats import chisquare

    target, draft = _quantized(quantization, seed=0).model, _quantized(quantization, seed=7, layers=1).model
    prompt = PROMPTS[0]
    p, q = (torch.softmax(ModelRunner(m, 1, 64).forward([0], [prompt], "last")[0] / 1.5, -1) for m in (target, draft))
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    drafts = torch.multinomial(q.expand(n, -1), 1, generator=gen)
    result = rejection_sample(drafts, [1] * n, p.expand(n, 2, -1).contiguous(), q.expand(n, 1, -1).contiguous(), gen)
    counts = torch.bincount(torch.tensor([t[0] for t in result.tokens]), minlength=len(p)).float()
    keep = p * n >= 5
    expected = p[keep] * n
    expected *= counts[keep].sum() / expected.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3
    assert chisquare(counts[keep], (q[keep] / q[keep].sum()) * counts[keep].sum()).pvalue < 1e-6


# ---- per-machine choices --------------------------------------------------------------------------------------
def test_auto_takes_w4a8_then_w8a8_on_x86_cpus_and_float_on_cuda(monkeypatch):
    monkeypatch.setattr(backends, "w8a8_supported", lambda: True)
    monkeypatch.setattr(backends, "w4a8_supported", lambda: True)
    assert resolve_quantization("auto", "cpu") == "w4a8"
    monkeypatch.setattr(backends, "w4a8_supported", lambda: False)  # no C compiler, or no AVX2
    assert resolve_quantization("auto", "cpu") == "w8a8"
    with pytest.raises(SpecDecodeError, match="w4a8 needs a C compiler"):
        resolve_quantization("w4a8", "cpu")
    assert resolve_quantization("auto", "cuda") == "none"
    monkeypatch.setattr(backends, "w8a8_supported", lambda: False)
    assert resolve_quantization("auto", "cpu") == "none"
    with pytest.raises(SpecDecodeError, match="w8a8 needs FBGEMM"):
        resolve_quantization("w8a8", "cpu")
    with pytest.raises(SpecDecodeError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", "cpu")


def test_weights_are_7_bit_without_vnni(monkeypatch):
    """AVX2's u8 x s8 pair sums saturate int16 with 8-bit weights; AVX512-VNNI sums in int32."""
    backends.cpu_flags.cache_clear()
    monkeypatch.setattr(backends, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert backends.int8_weight_max() == 63 and 2 * 255 * 63 <= 32767
    monkeypatch.setattr(backends, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert backends.int8_weight_max() == 127


def test_restricting_a_quantized_draft_vocabulary_keeps_its_rows():
    if not w8a8_supported():
        pytest.skip("FBGEMM is not available")
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
