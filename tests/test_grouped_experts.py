"""A GPU's mixture-of-experts layers by the grouped kernels (executor/grouped_experts.py), in Triton's interpreter on
a CPU (tests/conftest.py turns it on) and compiled with SPECDECODE_TEST_DEVICE=cuda: against PyTorch's path (routing,
grouping, activations, each row's experts summed), a row's bits the same alone and beside others, the runner's choice
of fixed shapes for such a model, and an engine's greedy speculation with them in fixed-shape forwards. Versions with
a mistake in their source fail."""

import pytest
import torch
from conftest import DEVICE, tiny_model, with_mistake

pytest.importorskip("triton", reason="the GPU kernels' tests need Triton (the test extras install it)")

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.executor import grouped_experts  # noqa: E402
from specdecode.executor import runner as runner_module  # noqa: E402
from specdecode.executor.runner import waits_on_host  # noqa: E402
from specdecode.models.layers import SparseMoE, linear_layers  # noqa: E402

ATOL = 1e-5 if DEVICE == "cpu" else 2e-2

MIXTURES = {
    "top-2 of 4, weights rescaled": dict(num_experts=4, experts_per_token=2),
    "top-3 of 8, 48-wide experts, GeGLU": dict(
        num_experts=8, experts_per_token=3, expert_intermediate_size=48, normalize_expert_weights=False,
        activation="gelu_tanh",
    ),
}  # fmt: skip


def _moe(module=grouped_experts, seed: int = 0, **mixture):
    """A tiny mixture of experts with `module`'s kernels in every MoE layer: its first such layer, and the model."""
    model = tiny_model(seed=seed, arch="mixtral", **(mixture or MIXTURES["top-2 of 4, weights rescaled"])).model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for moe in layers:
        moe.kernel = module.GroupedExperts(moe)
    return layers[0], model


def _pytorchs(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    kernel, moe.kernel = moe.kernel, None
    try:
        return moe(x)
    finally:
        moe.kernel = kernel


def _rows(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("mixture", MIXTURES, ids=list(MIXTURES))
@pytest.mark.parametrize("rows", [1, 7, 150])  # 150 rows: more pairs than one pass of the places kernel takes
def test_the_kernels_compute_pytorchs_mixture_of_experts(mixture, rows):
    moe, _ = _moe(**MIXTURES[mixture])
    x = _rows(rows)
    torch.testing.assert_close(moe(x), _pytorchs(moe, x), atol=ATOL, rtol=0)


def _places_hold(module, monkeypatch, rows: int = 150, tile: int = 16) -> bool:
    """Whether `module` places the pairs of `rows` rows over 4 experts (the places' programs reading `tile` pairs at a
    time): each pair at one place, in its expert's blocks, in pair order; every expert's group padded to whole blocks
    and the blocks past the last group marked past every expert."""
    monkeypatch.setattr(module, "PAIR_TILE", tile)
    moe, _ = _moe(module)
    _, chosen = moe.kernel.routed(moe, _rows(rows))
    pairs = chosen.numel()
    pair_at, block_expert = (t.cpu() for t in module._places(chosen, 4, module._places_for(pairs, 4)))
    experts = block_expert.repeat_interleave(module.BLOCK_M)
    past = experts == 4  # what such places hold is never read
    real = (pair_at >= 0) & ~past
    order = pair_at[real].long()
    return (
        sorted(order.tolist()) == list(range(pairs))
        and torch.equal(experts[real], chosen.reshape(-1).cpu()[order])
        and all(torch.all(order[experts[real] == e].diff() > 0) for e in range(4))
        and torch.equal(past, torch.arange(len(past)) >= (~past).sum())  # groups first, then what is past them
        and (~past).sum() == sum(-(-int((chosen == e).sum()) // module.BLOCK_M) for e in range(4)) * module.BLOCK_M
    )


@pytest.mark.parametrize("tile", [16, grouped_experts.PAIR_TILE], ids=["many passes", "one pass"])
def test_every_pair_has_one_place_in_its_experts_blocks(tile, monkeypatch):
    assert _places_hold(grouped_experts, monkeypatch, tile=tile)


@pytest.mark.parametrize(
    "old,new",
    [
        ("pair_at + start + seen + tl.cumsum", "pair_at + start + tl.cumsum"),
        ("(b * BLOCK_M < end)", "(b * BLOCK_M <= end)"),
        ("tl.where(ids < e, padded, 0)", "tl.where(ids < e, every, 0)"),
        ("tail = tl.where(e == 0, tl.sum(padded, axis=0), PLACES)", "tail = PLACES"),
    ],
    ids=[
        "places restart each pass",
        "a block at a group's end taken by the next expert too",
        "groups after the ones before them unpadded",
        "blocks past the last group unmarked",
    ],
)
def test_mistakes_in_placing_pairs_are_caught(old, new, tmp_path, monkeypatch):
    assert not _places_hold(with_mistake(grouped_experts, old, new, tmp_path, monkeypatch), monkeypatch)


@pytest.mark.parametrize("mixture", MIXTURES, ids=list(MIXTURES))
def test_a_rows_bits_are_the_same_alone_and_beside_other_rows(mixture):
    """Row 0 alone and first of 5 and of 40 rows (its pairs first in their experts' groups); on a GPU every row,
    wherever its pairs fall in their tiles (Triton's interpreter multiplies on the CPU, whose BLAS rounds the rows
    at a tile's edge otherwise)."""
    moe, _ = _moe(**MIXTURES[mixture])
    x = _rows(40)
    alone = moe(x[:1])
    for n in (5, 40):
        assert torch.equal(moe(x[:n])[0], alone[0])
    if DEVICE == "cuda":
        together = moe(x)
        assert all(torch.equal(together[i], moe(x[i : i + 1])[0]) for i in range(40))


def test_tiles_that_follow_the_row_count_are_caught(tmp_path, monkeypatch):
    """K in narrower tiles for calls of more pairs: a row's sums grouped otherwise beside other rows."""
    old = "\n            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,"  # the experts' calls
    broken = with_mistake(grouped_experts, old, old.replace("BLOCK_K,", "BLOCK_K if y.shape[0] <= 2 else 32,"),
                          tmp_path, monkeypatch)  # fmt: skip
    moe, _ = _moe(broken)
    x = _rows(5)
    assert not torch.equal(moe(x)[0], moe(x[:1])[0])


@pytest.mark.parametrize(
    "old,new",
    [
        ("rows = tl.where(real, pairs // PER_ROW, 0)", "rows = tl.where(real, pairs % PER_ROW, 0)"),
        ("acc += weight * tl.load(", "acc += tl.load("),
        ("    if NORMALIZE:\n", "    if not NORMALIZE:\n"),
        ('logits = tl.where((ids < NUM_EXPERTS)[None, :], logits, float("-inf"))', "logits = logits"),
        ("a = _activated(gate, up, ACT)", "a = _activated(up, gate, ACT)"),
    ],
    ids=[
        "a pair's row by remainder",
        "experts summed unweighted",
        "weights rescaled where they should not be, and not where they should",
        "the padding past the last expert routed to",
        "gate and up swapped",
    ],
)
def test_mistakes_in_the_experts_products_are_caught(old, new, tmp_path, monkeypatch):
    broken = with_mistake(grouped_experts, old, new, tmp_path, monkeypatch)
    moe, _ = _moe(broken)
    x = _rows(150)
    assert not torch.allclose(moe(x), _pytorchs(moe, x), atol=ATOL, rtol=0)


def test_a_model_whose_experts_take_the_kernels_never_waits_on_the_host():
    moe, model = _moe()
    assert not waits_on_host(model)
    assert all(id(e) not in {id(m) for m in linear_layers(model)} for e in moe.experts.modules())
    moe.kernel = None  # one layer left on PyTorch's path
    assert waits_on_host(model) and not waits_on_host(tiny_model(seed=0).model)
    assert sum(m is moe.experts[0].gate_up_proj for m in linear_layers(model)) == 1


def test_attaching_checks_the_kernels_on_the_models_own_experts(monkeypatch):
    """Attached to every MoE layer, each expert's weight a view into the stacked tensor (no second copy); PyTorch's path
    where asked; a kernel that fails its check leaves every layer on PyTorch's path."""
    model = tiny_model(seed=0, arch="mixtral", num_experts=4, experts_per_token=2, layers=3).model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    monkeypatch.setenv(runner_module.EXPERTS_CHOICE, "pytorch")
    assert runner_module.gpu_experts(model) == 0 and waits_on_host(model)
    monkeypatch.setenv(runner_module.EXPERTS_CHOICE, "triton")
    assert runner_module.gpu_experts(model) == 3
    assert all(isinstance(m.kernel, grouped_experts.GroupedExperts) for m in layers)
    stacked = layers[1].kernel.gate_up
    assert layers[1].experts[2].gate_up_proj.weight.data_ptr() == stacked[2].data_ptr()

    model = tiny_model(seed=0, arch="mixtral", num_experts=4, experts_per_token=2).model
    monkeypatch.setattr(grouped_experts.GroupedExperts, "routed", lambda self, moe, x: (None, None))
    assert grouped_experts.attach_grouped_experts(model) == 0 and waits_on_host(model)


def test_greedy_speculation_through_the_kernels_in_fixed_shapes_reproduces_plain_decoding(monkeypatch):
    """A mixture of experts' target in fixed-shape forwards with the kernels (what a GPU captures), drafts from a copy
    of its weights on PyTorch's path (accepted where the two agree): plain decoding's tokens, and PyTorch's path's."""
    monkeypatch.setenv(runner_module.EXPERTS_CHOICE, "pytorch")  # on a GPU: the kernels where this test puts them
    moe = dict(arch="mixtral", num_experts=4, experts_per_token=2)
    target, draft = tiny_model(seed=0, **moe), tiny_model(seed=0, **moe)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def generated(kernels: bool, k: int):
        for layer in target.model.modules():
            if isinstance(layer, SparseMoE):
                layer.kernel = grouped_experts.GroupedExperts(layer) if kernels else None
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: model is target.model and kernels)
        llm = LLM(target=target, draft=draft, num_speculative_tokens=k, max_model_len=64, progress=False,
                  speculation_policy="fixed")  # fmt: skip
        assert (llm.engine.runner._fixed is not None) == kernels
        outputs = llm.generate(prompts, params)
        return [out.outputs[0].token_ids for out in outputs], sum(out.spec["num_accepted_tokens"] for out in outputs)

    (speculated, accepted), (plain, _) = generated(True, 3), generated(True, 0)
    assert speculated == plain == generated(False, 0)[0]
    assert accepted > 8


def test_the_plans_activation_reserve_holds_what_the_kernels_make_for_a_prompt_chunk(monkeypatch):
    """Every tensor a call of the kernels makes (its pairs' gate/up and float32 outputs, the router's logits and the
    places), scaled to a 2,048-row prompt chunk, within the plan's activation reserve: with 8 narrow experts a row
    (more than a dense MLP's intermediate), a reserve by the dense MLP alone would fall short."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specdecode.engine.memory import activation_reserve
    from specdecode.executor.runner import PREFILL_CHUNK

    made, launching = [], [False]

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not launching[0]:  # the interpreter's copies of a launch's arguments are not the GPU's
                outs = out if isinstance(out, tuple) else (out,)
                made.extend(t.nbytes for t in outs if isinstance(t, torch.Tensor))
            return out

    class Launch:
        def __init__(self, jit):
            self.jit = jit

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launching[0] = True
                try:
                    return self.jit[grid](*args, **kwargs)
                finally:
                    launching[0] = False

            return run

    for name in ("_experts_matmul", "_count_pairs", "_place_pairs", "_sum_experts"):
        monkeypatch.setattr(grouped_experts, name, Launch(getattr(grouped_experts, name)))

    moe, model = _moe(num_experts=16, experts_per_token=8, expert_intermediate_size=32)
    rows = 64
    with Made():
        moe(_rows(rows))
    per_row = sum(made) / rows
    cfg = model.cfg
    assert per_row * PREFILL_CHUNK <= activation_reserve(cfg, torch.float32, PREFILL_CHUNK, 1, 0)
    dense_mlp = (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * 4
    assert per_row > dense_mlp
