"""Counting the copies of device values to the host that a piece of code makes (on a GPU each one waits for the
device), on any device: every tensor method that reads values out, seen through PyTorch's function overrides."""

from __future__ import annotations

from collections import Counter

from torch.overrides import TorchFunctionMode

# Tensor methods that copy values to the host (truth tests are left out: a CPU takes branches a GPU does not)
READS = {"tolist", "item", "__int__", "__float__", "__index__", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Within `with HostReads() as reads:`, reads.seen counts the host reads by method name."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.seen.values())
