"""Prometheus metrics of the server: speculation counters, latency histograms, queue gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.step import StepOutput
from ..metrics import SpecCounters

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._speculation_metrics(self.registry)
        self._request_metrics(self.registry)
        self.totals = SpecCounters()  # every decoding step's sequences, since start
        self._steps = self._speculated_steps = 0

    def _speculation_metrics(self, r: CollectorRegistry) -> None:
        self.steps = Counter("specdecode_steps", "Decoding steps", ["speculated"], registry=r)
        self.drafts = Counter("specdecode_spec_decode_num_drafts", "Sequence-steps that drafted tokens", registry=r)
        self.draft_tokens = Counter("specdecode_spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.accepted_tokens = Counter(
            "specdecode_spec_decode_num_accepted_tokens", "Accepted draft tokens", registry=r
        )
        self.accepted_per_pos = Counter(
            "specdecode_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position",
            ["position"],
            registry=r,
        )
        self.emitted_tokens = Counter("specdecode_generation_tokens", "Output tokens", registry=r)
        self.acceptance_rate = Gauge(
            "specdecode_spec_decode_acceptance_rate", "Accepted / drafted, since start", registry=r
        )
        self.mean_accepted_length = Gauge(
            "specdecode_spec_decode_mean_accepted_length",
            "Tokens per speculative step (bonus included), since start",
            registry=r,
        )
        self.speculating_fraction = Gauge(
            "specdecode_spec_decode_speculating_fraction", "Fraction of steps that drafted", registry=r
        )
        self.draft_lengths = Counter(
            "specdecode_spec_decode_draft_length",
            "Sequence-steps by tokens drafted (the speculation policy's decisions; 0 = plain decoding)",
            ["k"],
            registry=r,
        )
        self.lookup_drafts = Counter(
            "specdecode_spec_decode_num_lookup_drafts",
            "Sequence-steps whose drafts came from prompt lookup instead of the draft model (adaptive policy)",
            registry=r,
        )
        self.draft_cache_bytes = Gauge(
            "specdecode_suffix_cache_bytes",
            "Bytes of earlier outputs suffix speculation keeps to draft from (all tenants)",
            registry=r,
        )

    def _request_metrics(self, r: CollectorRegistry) -> None:
        self.running = Gauge("specdecode_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("specdecode_num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.slots = Gauge("specdecode_kv_cache_slots", "Sequences the memory plan's KV cache holds", registry=r)
        self.slot_tokens = Gauge(
            "specdecode_kv_cache_slot_tokens", "Tokens per KV-cache slot (max_model_len)", registry=r
        )
        self.batch_size = Gauge("specdecode_batch_size", "Sequences in the last decoding step", registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "specdecode_prompt_tokens_cached",
            "Prompt tokens found in the KV cache (prefix caching), not computed again",
            registry=r,
        )
        self.aborted = Counter("specdecode_requests_aborted", "Requests cancelled (e.g. client gone)", registry=r)
        self.preempted = Counter(
            "specdecode_preemptions", "Times a sequence gave its KV blocks back, to be recomputed later", registry=r
        )
        self.rejected = Counter(
            "specdecode_requests_rejected", "Requests refused with 429: the waiting queue was at its bound", registry=r
        )
        self.finished = Counter("specdecode_requests_finished", "Requests finished", ["reason"], registry=r)
        self.adapter_requests = Counter(
            "specdecode_lora_requests_finished", "Requests finished that named a served LoRA adapter", ["adapter"],
            registry=r,
        )  # fmt: skip
        self.adapter_tokens = Counter(
            "specdecode_lora_output_tokens", "Output tokens of finished requests, by LoRA adapter named", ["adapter"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specdecode_time_per_output_token_seconds", "TPOT", buckets=LATENCY_BUCKETS, registry=r)

    def set_capacity(self, slots: int, tokens_per_slot: int) -> None:
        self.slots.set(slots)
        self.slot_tokens.set(tokens_per_slot)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_step(self, out: StepOutput) -> None:
        step = out.counters
        speculated = step.num_draft_tokens > 0
        self.steps.labels(speculated=str(speculated).lower()).inc()
        self.batch_size.set(out.batch_size)
        self.drafts.inc(step.num_spec_steps)
        self.draft_tokens.inc(step.num_draft_tokens)
        self.accepted_tokens.inc(step.num_accepted_tokens)
        self.emitted_tokens.inc(step.num_emitted_tokens)
        for pos, n in enumerate(step.accepted_per_position):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        for k in out.draft_lengths:
            self.draft_lengths.labels(k=str(k)).inc()
        self.lookup_drafts.inc(out.lookup_drafts)
        self.draft_cache_bytes.set(out.draft_cache_bytes)
        self.preempted.inc(out.preempted)
        self.totals.merge(step)
        self._steps += 1
        self._speculated_steps += speculated
        if self.totals.num_draft_tokens:
            self.acceptance_rate.set(self.totals.acceptance_rate)
            self.mean_accepted_length.set(self.totals.mean_accepted_length)
        self.speculating_fraction.set(self._speculated_steps / self._steps)
        for seq in out.finished:
            self.finished.labels(reason=seq.finish_reason or "unknown").inc()
            self.prompt_tokens.inc(seq.metrics.num_prompt_tokens)
            self.cached_prompt_tokens.inc(seq.metrics.num_cached_prompt_tokens)
            if seq.adapter:
                self.adapter_requests.labels(adapter=seq.adapter).inc()
                self.adapter_tokens.labels(adapter=seq.adapter).inc(seq.metrics.num_output_tokens)
            if seq.metrics.ttft is not None:
                self.ttft.observe(seq.metrics.ttft)
            if seq.metrics.tpot is not None:
                self.tpot.observe(seq.metrics.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
