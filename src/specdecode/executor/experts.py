"""A mixture of experts' MLP by the low-bit kernel (kernels/lowbit.c, lowbit_moe): one call per layer routes
every row to its experts, reads each chosen expert's weights once for all the rows routed to it, and sums
each row's experts in ascending order, where the PyTorch path makes three calls and a dozen small
operations per expert (a decoded token of a 32-expert top-4 model: 96 experts a step)."""

from __future__ import annotations

import torch

from .quant import ERRORS as LINEAR_ERRORS
from .quant import BlockLinear, _check

# lowbit_moe's codes: lowbit_linear's, but -6 names an expert where a lookup names a token
ERRORS = {**LINEAR_ERRORS, -6: "an expert id outside the experts"}


class ExpertsKernel:
    """Replaces SparseMoE's router and expert loop: (the SparseMoE, its flat input rows [N, hidden]) ->
    [N, hidden]. Each row is routed in the kernel, by the same definitions as Router (softmax or sigmoid scores, a
    selection bias, a scale; in another order of float operations: a row's experts are the router's up to a near-tie
    of scores)."""

    def __init__(self, lib, experts, passes: int):
        self.gate_ups, self.downs = [e.gate_up_proj for e in experts], [e.down_proj for e in experts]
        self.lib, self.passes = lib, passes
        self.formats = (self.gate_ups[0].format.id, self.gate_ups[0].S, self.downs[0].format.id, self.downs[0].S)
        self.inter = self.downs[0].in_features
        self._tables_for = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' buffer addresses, taken again when the modules' buffers have moved (to huge pages, say)."""
        now = self.gate_ups[0].buffer_addresses
        if self._tables_for != now:
            self._tables = tuple(
                torch.tensor([layer.buffer_addresses for layer in layers], dtype=torch.int64)
                for layers in (self.gate_ups, self.downs)
            )
            self._tables_for = now
        return self._tables

    @staticmethod
    def applies(moe) -> bool:
        """Every expert's layers as single block layers of one format per kind, without padding rows or biases, with
        the activation the kernel computes (SiLU), under a router whose logits are unbiased (gpt-oss's are not)."""
        experts = moe.experts
        layers = [[e.gate_up_proj for e in experts], [e.down_proj for e in experts]]
        return (
            experts[0].activation == "silu"
            and moe.gate.bias is None
            and all(
                isinstance(x, BlockLinear)
                and x.bias is None
                and x.rows == x.out_features
                and (x.format, x.S) == (kind[0].format, kind[0].S)
                for kind in layers
                for x in kind
            )
        )

    def __call__(self, moe, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.float().contiguous()
        gate = moe.gate
        router = gate.weight.float().contiguous()
        bias = None if gate.selection_bias is None else gate.selection_bias.float().contiguous()
        rows, hidden = flat.shape
        y, top = torch.empty(rows, hidden), gate.top_k
        chosen, weights = torch.empty(rows, top, dtype=torch.int64), torch.empty(rows, top)
        gate_up, down = self.tables()
        grouping = torch.tensor([gate.groups, gate.groups_kept, int(gate.group_scoring == "top2")], dtype=torch.int32)
        _check(
            self.lib.lowbit_moe(
                *self.formats,
                flat.data_ptr(),
                rows,
                hidden,
                self.inter,
                len(gate_up),
                router.data_ptr(),
                int(gate.normalize),
                int(gate.sigmoid),
                None if bias is None else bias.data_ptr(),
                gate.scale,
                grouping.data_ptr(),
                chosen.data_ptr(),
                weights.data_ptr(),
                top,
                gate_up.data_ptr(),
                down.data_ptr(),
                y.data_ptr(),
                self.passes,
                torch.get_num_threads(),
            ),
            "a mixture of experts' MLP",
            ERRORS,
        )
        return y


def attach_experts_kernels(model, passes: int) -> int:
    """Give the model's mixture-of-experts layers the kernel where it applies; how many it did."""
    from ..models.layers import SparseMoE
    from .quant import lowbit_kernel

    lib, attached = lowbit_kernel(), 0
    for module in model.modules():
        if isinstance(module, SparseMoE) and lib is not None and ExpertsKernel.applies(module):
            module.kernel = ExpertsKernel(lib, module.experts, passes)
            attached += 1
    return attached
