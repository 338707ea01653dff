"""The engine's step loop in one background thread: requests join and leave between steps (continuous
batching), and each request's new text reaches its asyncio consumer as it is produced."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.sequence import Sequence
from ..engine.step import SequenceUpdate, StepOutput
from ..errors import SpecDecodeError
from ..sampling import SamplingParams, TokenLogprob
from .metrics import ServerMetrics

log = logging.getLogger("specdecode.server")


class QueueFull(SpecDecodeError):
    """Every sequence slot is busy and the waiting queue is at its bound: the client should retry later."""

    http_status = 429


class RequestTimeout(SpecDecodeError):
    """The request ran past its time limit and was cancelled."""

    http_status = 504


class EngineFailed(SpecDecodeError):
    """A step of the engine raised (a bug, not the request): the requests in it fail, the server carries on."""

    http_status = 500


class ShuttingDown(SpecDecodeError):
    """The server is draining before it stops: no new requests; those still running at the end are cancelled."""

    http_status = 503


@dataclass
class Update:
    """News about one of a request's n outputs (`index`); plain data, so that it can cross processes."""

    text: str  # new text since the previous update
    finished: bool = False  # this output is complete
    finish_reason: str | None = None
    error: Exception | None = None  # the whole request failed
    stop_reason: str | int | None = None  # once finished: the stop string or stop token id that ended it
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens generated since the last update
    num_tokens: int = 0  # output tokens so far
    token_ids: list[int] = field(default_factory=list)  # the output tokens since the last update
    prompt_logprobs: list | None = None  # the prompt's, in the output's first update when asked for
    spec: dict | None = None  # the output's speculation statistics, once finished
    replica: str | None = None  # which engine replica served it (scaled-out deployments)


@dataclass
class RequestHandle:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    tenant: str = ""
    adapter: str = ""
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    seqs: list[Sequence] = field(default_factory=list)  # its n outputs, once the engine has them
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    opened: set[int] = field(default_factory=set)  # outputs whose first update is out
    closed: set[int] = field(default_factory=set)  # outputs whose final update is out

    def push(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(seq.finished for seq in self.seqs)


class AsyncEngine:
    """max_waiting: requests that may wait for a sequence slot beyond those running (None: unbounded);
    past it, submit() refuses at once instead of letting the queue and every client's wait grow. sampling_defaults:
    what a request's unset sampling fields take (the LLM's, from the model's generation config)."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        replica: str | None = None,
        sampling_defaults: dict | None = None,
    ):
        self.engine = engine
        self.sampling_defaults = dict(sampling_defaults or {})
        # what the HTTP layer reads of the engine (server/handler.py's ServingEngine)
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.vocab_size = engine.runner.cfg.vocab_size
        self.adapters = engine.runner.adapters  # a new list each time the engine thread changes them
        self.replica = replica
        self.max_waiting = max_waiting
        # requests accepted (event-loop thread) and ended (engine thread); their difference is in flight
        self._submitted = self._ended = 0
        self.metrics = metrics or ServerMetrics()
        self.metrics.set_capacity(engine.runner.num_slots, engine.runner.max_len)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: list[RequestHandle] = []
        self._outputs: dict[int, tuple[RequestHandle, int]] = {}  # id of a sequence -> its request, output index
        self._stopping = False
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)

    # ---- what the HTTP layer reads (server/handler.py's ServingEngine) ----------------------------------
    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    def start(self) -> None:
        """Run the step loop in a thread of its own."""
        self._thread.start()

    def run(self) -> None:
        """Run the step loop in the calling thread until stop(). `serve` gives it the main thread: that is
        where the models were loaded, and kernels called from another thread would start a second
        OpenMP thread pool, which oversubscribes the cores, so OpenMP makes idle workers sleep at once
        instead of spinning and every kernel call pays their wake-up
        (docs/decisions.md#the-servers-engine-thread)."""
        self._run()

    def stop(self) -> None:
        """Cancel what is still running and end the loop (called on shutdown, e.g. SIGTERM)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def drain(self, grace_seconds: float) -> list[str]:
        """Refuse new requests, give the running ones up to grace_seconds to finish, then cancel the rest.
        Returns the ids of the cancelled requests. Called from a thread other than the engine's."""
        self.draining = True
        deadline = time.monotonic() + grace_seconds
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.in_flight:
            return []
        cancelled: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("cancel_all", cancelled))
        self._wake.set()
        return cancelled.result(timeout=30)

    async def change_adapters(self, change) -> None:
        """Run change(engine) on the engine's thread between steps: a served LoRA adapter loaded or unloaded
        (engine/adapters.py); its error, if any, raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("adapters", (change, done)))
        self._wake.set()
        await asyncio.wrap_future(done)

    @property
    def in_flight(self) -> int:
        return self._submitted - self._ended

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
        streamed: bool = True,
        tenant: str = "",
        adapter: str = "",
    ) -> RequestHandle:
        """Queue a request (raises QueueFull when the waiting queue is at its bound, ShuttingDown while the
        server drains). session (which conversation it belongs to) and streamed (whether its client sees each
        update) matter to deployments of several engines, which route and retry by them; tenant (who asks)
        scopes the outputs suffix speculation may draft from; adapter: the served LoRA adapter to compute with."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; send the request to another replica or retry later")
        if self.max_waiting is not None and self.in_flight >= self.engine.runner.num_slots + self.max_waiting:
            self.metrics.rejected.inc()
            raise QueueFull(
                f"the server is at capacity ({self.engine.runner.num_slots} running, "
                f"{self.max_waiting} waiting); retry shortly"
            )
        handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop(), tenant=tenant, adapter=adapter)
        self._submitted += 1
        self._inbox.put(("add", handle))
        self._wake.set()
        return handle

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        """submit() and updates() in one: yields Updates until the request finishes."""
        async for update in self.updates(self.submit(prompt_ids, params)):
            yield update

    async def updates(self, handle: RequestHandle, timeout: float | None = None):
        """Yields a submitted request's Updates until all its outputs finish; closing the iterator early
        aborts it, and so does running past `timeout` seconds (RequestTimeout)."""
        unfinished = handle.params.n
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while unfinished:
                try:
                    update = await asyncio.wait_for(
                        handle.updates.get(), None if deadline is None else deadline - time.monotonic()
                    )
                except TimeoutError:
                    raise RequestTimeout(
                        f"the request ran past its time limit of {timeout:g} s and was cancelled; "
                        "ask for fewer tokens or a longer timeout"
                    ) from None
                if update.error is not None:
                    unfinished = 0
                    raise update.error
                unfinished -= update.finished
                yield update
        finally:
            if unfinished:  # client went away: free its slots and KV now
                self._inbox.put(("abort", handle))
                self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                out = self.engine.step()
            except Exception as exc:  # a bug must not take the server down: fail the batch, carry on
                log.exception("engine step failed")
                self._fail_all(EngineFailed(f"the engine failed while running this request ({exc}); retry it"))
                continue
            self.metrics.observe_step(out)
            self._publish(out)
        self._fail_all(RuntimeError("server shutting down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "adapters":
                self._change_adapters(*handle)
            elif kind == "cancel_all":
                ids = [h.seqs[0].request_id for h in self._active if h.seqs]
                self._fail_all(ShuttingDown("the server shut down before this request finished; retry it"))
                self.metrics.aborted.inc(len(ids))
                handle.set_result(ids)
            elif kind == "add":
                try:
                    handle.seqs = self.engine.add_group(handle.prompt_ids, handle.params, handle.tenant, handle.adapter)
                    handle.sent_chars, handle.sent_tokens = [0] * len(handle.seqs), [0] * len(handle.seqs)
                    self._outputs.update((id(seq), (handle, i)) for i, seq in enumerate(handle.seqs))
                except Exception as exc:
                    handle.push(Update("", True, error=exc))
                    self._ended += 1
                    continue
                self._active.append(handle)
            elif handle in self._active:
                for seq in handle.seqs:
                    self.engine.abort(seq)
                    self._outputs.pop(id(seq), None)
                self._active.remove(handle)
                self._ended += 1
                self.metrics.aborted.inc()
        self.metrics.set_queue(self.engine.num_running, len(self.engine.waiting))

    def _change_adapters(self, change, done: concurrent.futures.Future) -> None:
        try:
            change(self.engine)
        except Exception as exc:  # a bad adapter is the caller's answer, not the server's end
            done.set_exception(exc)
            return
        self.adapters = self.engine.runner.adapters
        done.set_result(None)

    def _publish(self, out: StepOutput) -> None:
        """Stream what the step gave the sequences it names; a request whose outputs have all finished leaves."""
        for update in out.outputs:
            if id(update.seq) in self._outputs:
                self._publish_output(*self._outputs[id(update.seq)], update)
        for seq in out.finished:
            self._outputs.pop(id(seq), None)
        still_active = [handle for handle in self._active if not handle.finished]
        self._ended += len(self._active) - len(still_active)
        self._active = still_active
        self.metrics.set_queue(self.engine.num_running, len(self.engine.waiting))

    def _publish_output(self, handle: RequestHandle, i: int, update: SequenceUpdate) -> None:
        """New text of output i, with the logprobs of the tokens the step gave it."""
        if i in handle.closed:
            return
        seq = update.seq
        text = self._streamable_text(seq, handle.sent_chars[i])
        logprobs = update.logprobs or []
        if text or logprobs or seq.finished:
            handle.push(
                Update(
                    text,
                    seq.finished,
                    seq.finish_reason,
                    index=i,
                    logprobs=logprobs,
                    prompt_logprobs=None if i in handle.opened else seq.prompt_logprobs,
                    num_tokens=seq.num_output_tokens,
                    token_ids=seq.token_ids[seq.num_prompt_tokens + handle.sent_tokens[i] :],
                    spec=seq.metrics.as_dict() if seq.finished else None,
                    replica=self.replica,
                    stop_reason=seq.stop_reason,
                )
            )
            handle.sent_chars[i] += len(text)
            handle.sent_tokens[i] = seq.num_output_tokens
            handle.opened.add(i)
            if seq.finished:
                handle.closed.add(i)

    @staticmethod
    def _streamable_text(seq: Sequence, sent: int) -> str:
        """seq's text from character `sent` on that may go out now: only that tail is copied, as a long stream's whole
        text each step would cost in proportion to its length."""
        text, end = seq.text, len(seq.text)
        if not seq.finished:
            # hold back what a stop string could still claim, and a half-decoded UTF-8 character
            end = max(sent, end - max((len(s) - 1 for s in seq.params.stop_strings), default=0))
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
        return text[sent:end]

    def _fail_all(self, exc: Exception) -> None:
        for handle in self._active:
            for seq in handle.seqs:
                if not seq.finished:
                    self.engine.abort(seq)
            handle.push(Update("", True, error=exc))
        self._ended += len(self._active)
        self._active = []
        self._outputs.clear()
