"""Timing the engine's phases without waiting for the device.

On a CPU the host computes each forward itself, and its clock times it. On a GPU the host only queues work: its
clock read after a launch says when the launch returned, and synchronising to learn when the work ended leaves the
device idle while the host prepares what comes next (a step of a few launches would pay that gap after each). So a
phase runs between two marks, each an event in the device's queue beside the host's time, and the device's time
between them is read once the host has waited for the step's results anyway: by then both marks have passed.
`now()` still synchronises, for start-up profiles and benchmarks that time whole runs."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def now() -> float:
    """Wall clock after the accelerator has finished queued work (start-up profiles, benchmarks: not per step)."""
    if _device_queue():
        torch.cuda.synchronize()
    return time.perf_counter()


def _device_queue() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True)
class Mark:
    """A moment as the host saw it and, where a GPU runs the work, as the device's queue reaches it."""

    host: float
    event: torch.cuda.Event | None = None

    @property
    def passed(self) -> bool:
        """Whether the device has reached it (reading the time up to it would not wait)."""
        return self.event is None or self.event.query()


def mark() -> Mark:
    if not _device_queue():
        return Mark(time.perf_counter())
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return Mark(time.perf_counter(), event)


def seconds_between(start: Mark, end: Mark) -> float:
    """The device's time from `start` to `end` where both are in its queue (waiting for `end` if it has not passed:
    callers read it after the step's results), else the host's."""
    if start.event is None or end.event is None:
        return end.host - start.host
    end.event.synchronize()
    return start.event.elapsed_time(end.event) / 1000


@dataclass
class Span:
    """One timed call (StepTimer.measure yields it): its seconds, read once its end has passed."""

    start: Mark
    end: Mark | None = None

    @property
    def seconds(self) -> float:
        return seconds_between(self.start, self.end)


PHASES = ("target", "draft", "draft_prefill", "propose")


class StepTimer:
    """Time and call counts of the target's decode forwards and the draft's forwards (for the cost ratio c), and of
    whole proposer calls ("propose": draft forwards plus their bookkeeping, or a lookup). A draft forward that still
    reads a prompt is the draft's prefill, counted apart as the target's prefill is: it is paid once a request, not
    per step. Spans still queued on the device are added once they have passed (`settle`, or reading a total)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (a benchmark's measured run after its warm-up)."""
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._calls = dict.fromkeys(PHASES, 0)
        self._queued: list[tuple[str, Span]] = []

    @contextmanager
    def measure(self, which: str):
        """Time one call, added to `which`'s totals; the yielded span gives its seconds once it has passed."""
        span = Span(mark())
        yield span
        span.end = mark()
        self.record(which, span)

    def record(self, which: str, seconds: float | Span, calls: int = 1) -> None:
        self._calls[which] += calls
        if isinstance(seconds, Span) and seconds.end.event is not None:
            self._queued.append((which, seconds))
        else:
            self._seconds[which] += seconds if isinstance(seconds, float | int) else seconds.seconds

    def settle(self, wait: bool = False) -> None:
        """Add the spans the device has passed (with `wait`, every span: reading a total waits for them)."""
        still = []
        for which, span in self._queued:
            if wait or span.end.passed:
                self._seconds[which] += span.seconds
            else:
                still.append((which, span))
        self._queued = still

    def _total(self, which: str) -> float:
        self.settle(wait=True)
        return self._seconds[which]

    target_time = property(lambda self: self._total("target"))
    draft_time = property(lambda self: self._total("draft"))
    draft_prefill_time = property(lambda self: self._total("draft_prefill"))
    propose_time = property(lambda self: self._total("propose"))
    target_calls = property(lambda self: self._calls["target"])
    draft_calls = property(lambda self: self._calls["draft"])
    draft_prefill_calls = property(lambda self: self._calls["draft_prefill"])

    @property
    def target_step_s(self) -> float | None:
        return self.target_time / self.target_calls if self.target_calls else None

    @property
    def draft_step_s(self) -> float | None:
        return self.draft_time / self.draft_calls if self.draft_calls else None
