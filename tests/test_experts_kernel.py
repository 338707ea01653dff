"""The mixture-of-experts kernel (kernels/lowbit.c, lowbit_moe): the experts' MLP of the PyTorch path up to the
router's float order, each row the same bits whatever other rows share the call (so a verified token gets a
decoded token's logits) and every build the scalar reference's bits."""

import pytest
import torch
from conftest import kernel_builds, random_hf_weights, tiny_config

from specdecode.executor.backends import build_quantized_model, quantize_weights
from specdecode.executor.experts import ExpertsKernel
from specdecode.executor.kernels import load
from specdecode.executor.quant import lowbit_kernel

pytestmark = pytest.mark.skipif(lowbit_kernel() is None, reason="the low-bit kernel needs a C compiler")


def _moe(quantization: str = "w8a8", experts: int = 8, top: int = 2, normalize: bool = True, **router):
    cfg = tiny_config(
        arch="mixtral",
        hidden=64,
        intermediate=96,
        num_experts=experts,
        experts_per_token=top,
        normalize_expert_weights=normalize,
        **router,
    )
    model = build_quantized_model(
        cfg, quantize_weights(random_hf_weights(cfg, 0).items(), quantization), quantization, "cpu"
    )
    moe = model.layers[0].mlp
    assert isinstance(moe.kernel, ExpertsKernel)
    return moe


ROWS = torch.randn(7, 1, 64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8-all", "w4a16"])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_kernel_computes_the_pytorch_paths_experts(quantization, normalize):
    moe = _moe(quantization, normalize=normalize)
    got = moe(ROWS)
    moe.kernel = None
    torch.testing.assert_close(got, moe(ROWS), rtol=1e-5, atol=1e-5)


# GLM-4.5's router (sigmoid scores, a selection bias, a scale), ERNIE 4.5's (softmax, a selection bias) and
# DeepSeek's (V3's: GLM-4.5's among the best 2 of 4 groups by their best two; V2's: softmax, groups by their best),
# which the kernel computes too
DEEPSEEK_V3_GROUPS = dict(expert_groups=4, expert_groups_kept=2, expert_group_scoring="top2")
OTHER_ROUTERS = {
    "sigmoid-biased-scaled": dict(expert_scoring="sigmoid", expert_selection_bias=True, expert_weights_scale=2.5),
    "softmax-biased": dict(expert_selection_bias=True),
    "deepseek-v3": dict(
        expert_scoring="sigmoid", expert_selection_bias=True, expert_weights_scale=2.5, **DEEPSEEK_V3_GROUPS
    ),
    "deepseek-v2-groups": dict(expert_groups=4, expert_groups_kept=2, expert_group_scoring="max"),
}


@pytest.mark.parametrize("router", OTHER_ROUTERS.values(), ids=OTHER_ROUTERS.keys())
def test_the_kernel_computes_the_experts_another_router_chose(router):
    moe = _moe(**router)
    assert not moe.gate.plain
    got = moe(ROWS)
    moe.kernel = None
    torch.testing.assert_close(got, moe(ROWS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("left_out", [dict(sigmoid=False), dict(selection_bias=None), dict(scale=1.0)])
def test_the_kernel_routing_without_one_of_glm_4_5s_features_fails_the_comparison(left_out):
    """The comparison above can fail: the kernel routing by softmax, without the bias or without the scale computes
    another MLP than GLM-4.5's router chooses and weighs."""
    moe = _moe(**OTHER_ROUTERS["sigmoid-biased-scaled"])
    kernel, moe.kernel = moe.kernel, None
    reference = moe(ROWS)
    for name, value in left_out.items():
        setattr(moe.gate, name, value)
    assert not torch.allclose(kernel(moe, ROWS.reshape(-1, 64)).view_as(ROWS), reference, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("left_out", [dict(groups=1), dict(group_scoring="max"), dict(groups_kept=4)])
def test_the_kernel_routing_without_deepseeks_groups_fails_the_comparison(left_out):
    """The kernel choosing among all experts, or among groups scored by their best one or kept all, computes another
    MLP than DeepSeek-V3's router chooses."""
    moe = _moe(experts=16, **OTHER_ROUTERS["deepseek-v3"])
    kernel, moe.kernel = moe.kernel, None
    reference = moe(ROWS)
    for name, value in left_out.items():
        setattr(moe.gate, name, value)
    assert not torch.allclose(kernel(moe, ROWS.reshape(-1, 64)).view_as(ROWS), reference, rtol=1e-3, atol=1e-3)


def test_each_row_is_computed_as_if_alone():
    moe = _moe(experts=8, top=3)
    together = moe(ROWS)
    assert torch.equal(together, torch.cat([moe(ROWS[i : i + 1]) for i in range(len(ROWS))]))


@pytest.mark.parametrize("isa", kernel_builds(amx_tiles=True))
def test_every_build_gives_the_scalar_reference_bits(isa):
    moe = _moe()
    moe.kernel.lib = load("lowbit", "scalar")
    reference = moe(ROWS)
    moe.kernel.lib = load("lowbit", isa)
    assert torch.equal(moe(ROWS), reference)


def test_wrong_top_k_fails_the_comparison():
    """The comparison above can fail: the kernel routing to one expert fewer computes another MLP."""
    moe = _moe(top=3)
    reference = moe(ROWS)
    moe.gate.top_k = 2
    assert not torch.allclose(moe(ROWS), reference, rtol=1e-3, atol=1e-3)


def test_an_expert_id_outside_the_table_is_refused():
    from specdecode.errors import SpecDecodeError

    moe = _moe()
    moe.gate.top_k = 9  # more experts than there are
    with pytest.raises(SpecDecodeError, match="mixture of experts"):
        moe(ROWS)
