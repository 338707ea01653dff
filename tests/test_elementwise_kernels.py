"""The elementwise kernels (RMSNorm with the residual add, SwiGLU and GeGLU): the numbers of the PyTorch path, each
row computed as if alone, the AVX2 build equal to the native one, and greedy speculation on a model that
uses them equal to plain decoding."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ByteTokenizer, kernel_builds, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.executor.attention import attach_attention_kernel
from specdecode.executor.elementwise import ActMulKernel, NormKernel, attach_elementwise_kernels
from specdecode.executor.kernels import load
from specdecode.executor.runner import ModelRunner
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import RMSNorm

pytestmark = pytest.mark.skipif(load("norm") is None, reason="the kernels need a C compiler")


def _norm(dim=1536, seed=0):
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return norm


def test_norm_and_residual_add_compute_what_pytorch_does():
    norm, kernel = _norm(), NormKernel(load("norm"))
    x, residual = torch.randn(5, 1536), torch.randn(5, 1536)
    torch.testing.assert_close(kernel(norm, x), norm(x), rtol=1e-6, atol=1e-6)
    expected_out, expected_sum = norm(x, residual)
    out, summed = kernel(norm, x, residual.clone())
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_mul_computes_what_pytorch_does_over_the_whole_range(activation):
    gate = torch.linspace(-120, 120, 20001)
    gate_up = torch.stack([torch.cat([gate, torch.full_like(gate, 3.0)])])
    got = ActMulKernel(load("norm"), activation)(gate_up)
    assert torch.isfinite(got).all()
    if activation == "silu":
        torch.testing.assert_close(got, F.silu(gate)[None] * 3.0, rtol=2e-6, atol=1e-30)
        return
    # in float32, 1 + tanh(y) cancels below x = -5 (PyTorch's GELU is 0 from x = -8); float64 holds it to e-15
    expected = (F.gelu(gate.double(), approximate="tanh")[None] * 3.0).float()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-12)


def test_gelu_without_its_cubic_term_fails_the_comparison():
    """The bound above is tight enough to catch a GELU missing its 0.044715 x^3."""
    gate = torch.linspace(-6, 6, 2001)
    wrong = gate * torch.sigmoid(1.5957691216057308 * gate)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, F.gelu(gate.double(), approximate="tanh").float(), rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("rows", [3, 40])  # below and above the row count where threads join
def test_each_row_is_computed_as_if_alone(rows):
    lib, norm = load("norm"), _norm(256)
    x, residual, gate_up = torch.randn(rows, 256), torch.randn(rows, 256), torch.randn(rows, 2 * 512)
    batch_out, batch_sum = NormKernel(lib)(norm, x, residual.clone())
    kernels = [ActMulKernel(lib, activation) for activation in ACTIVATIONS]
    batch_act = [kernel(gate_up) for kernel in kernels]
    for r in range(rows):
        out, summed = NormKernel(lib)(norm, x[r : r + 1], residual[r : r + 1].clone())
        assert torch.equal(out[0], batch_out[r]) and torch.equal(summed[0], batch_sum[r])
        for kernel, batch in zip(kernels, batch_act):
            assert torch.equal(kernel(gate_up[r : r + 1])[0], batch[r])


@pytest.mark.parametrize("isa", kernel_builds())
def test_every_build_gives_the_scalar_reference_bits(isa):
    norm, x, residual, gate_up = _norm(), torch.randn(4, 1536), torch.randn(4, 1536), torch.randn(4, 2 * 8960) * 8
    gate_up[0, :8960] = torch.linspace(-120, 120, 8960)  # past exp's clamps on both sides
    scalar, build = load("norm", "scalar"), load("norm", isa)
    reference_out, reference_sum = NormKernel(scalar)(norm, x, residual.clone())
    out, summed = NormKernel(build)(norm, x, residual.clone())
    assert torch.equal(out, reference_out) and torch.equal(summed, reference_sum)
    for activation in ACTIVATIONS:
        assert torch.equal(ActMulKernel(build, activation)(gate_up), ActMulKernel(scalar, activation)(gate_up))


def _with_kernels(seed=0, kv_cache_dtype="auto", **cfg):
    model = tiny_model(seed=seed, **cfg).model
    assert attach_elementwise_kernels(model)
    attach_attention_kernel(model, kv_cache_dtype)
    return model


def test_a_model_with_the_kernels_tracks_pytorch_and_speculation_stays_exact():
    prompt = list(range(1, 40))
    logits = []
    for model in (tiny_model(seed=0).model, _with_kernels(kv_cache_dtype="float32")):  # PyTorch's cache
        runner = ModelRunner(model, 1, 128)
        slot = runner.allocate()
        logits.append(runner.forward([slot], [prompt], "all"))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)

    target = LoadedModel("tiny-kernels", _with_kernels(), ByteTokenizer(64), tiny_model().config)
    draft = LoadedModel(
        "tiny-kernels-draft", _with_kernels(seed=7, layers=1), ByteTokenizer(64), tiny_model(seed=7, layers=1).config
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9, 41], [60, 1, 1, 7]]
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=128).generate(prompts, params)
    spec = LLM(
        target=target, draft=draft, num_speculative_tokens=3, max_model_len=128, speculation_policy="fixed"
    ).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.spec["num_draft_tokens"] for o in spec) > 0


def test_a_call_out_of_range_is_refused_with_a_code():
    from specdecode.executor.kernels import load

    lib = load("norm", "scalar")
    x, w, out = torch.ones(2, 8), torch.ones(8), torch.empty(2, 8)
    assert lib.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 2, 8, 1e-6, 1) == 0
    assert lib.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 2, 0, 1e-6, 1) == -1  # no width
    assert lib.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 2, 8, float("nan"), 1) == -1
    assert lib.add_rms_norm(x.data_ptr(), x.data_ptr(), w.data_ptr(), 0, 2, 8, 1e-6, 1) == -2  # no output
    assert lib.silu_mul(x.data_ptr(), 0, 1, 4, 1) == -2
    assert lib.gelu_tanh_mul(x.data_ptr(), 0, 1, 4, 1) == -2
