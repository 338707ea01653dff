"""Scale-out on Ray Serve: N engine replicas, each a whole engine (target, draft, speculation policy,
memory plan), behind one OpenAI-compatible ingress with the same endpoints, errors and API key as `serve`.

    HTTP -> Ray Serve proxy -> OpenAIIngress: api.build_app over RemoteEngines
         -> deployment handle, routed by SessionAffinityRouter -> EngineReplica: LLM + AsyncEngine

Each replica's adaptive policy decides from its own load, so replicas need no coordination; the router
spreads requests and keeps a conversation (the request's `user` field or an `X-Session-Id` header) on the
replica whose KV and acceptance statistics already know it. `ray` is an optional extra: nothing here is
imported unless a Ray deployment is asked for.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

from ..errors import SpecDecodeError
from ..sampling import SamplingParams
from .api import MAX_REQUEST_BYTES, build_app
from .async_engine import AsyncEngine, Update
from .replica_metrics import merge_replica_metrics

METRICS_PUSH_SECONDS = 1.0
METRICS_STALE_SECONDS = 15.0  # a replica silent this long is gone (Ray restarts it under a new id)
ENGINE_DEPLOYMENT = "EngineReplica"


class ReplicaDied(SpecDecodeError):
    """The replica serving a request died after the request had started streaming."""

    http_status = 503


# ---- routing ---------------------------------------------------------------------------------------
class SessionAffinityRouter(FIFOMixin, RequestRouter):
    """A request that names a session goes to the replica that ranks highest for it by rendezvous hashing
    (adding or losing a replica moves only the sessions it gains or held), the others ranked after it in
    case it is full; a request without one goes to the less loaded of two random replicas."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        session = (pending_request.kwargs or {}).get("session") if pending_request is not None else None
        if not session:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = sorted(candidate_replicas, key=lambda r: _affinity(session, r.replica_id.unique_id), reverse=True)
        return [[replica] for replica in ranked]


def _affinity(session: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest(), "big")


# ---- metrics: one scrape endpoint for every replica ------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsHub:
    """Replicas push their Prometheus text here; the ingress serves them merged, with a replica label."""

    def __init__(self):
        self._texts: dict[str, tuple[float, bytes]] = {}
        self._pushes: dict[str, int] = {}

    def put(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)
        self._pushes[replica] = self._pushes.get(replica, 0) + 1

    def pushes(self) -> dict[str, int]:
        """How many times each replica has pushed: a push counted after a moment shows all done before it."""
        return dict(self._pushes)

    def live(self) -> dict[str, bytes]:
        now = time.monotonic()
        return {r: text for r, (at, text) in self._texts.items() if now - at < METRICS_STALE_SECONDS}


# ---- the replicas -------------------------------------------------------------------------------------
class EngineReplica:
    """One engine. The model is loaded on the thread that then runs the step loop (see AsyncEngine.run)."""

    def __init__(self, llm_factory, hub, max_waiting: int | None):
        self.replica = serve.get_replica_context().replica_id.unique_id
        loaded, failure = threading.Event(), []
        self.engine: AsyncEngine | None = None

        def load_and_run():
            try:
                llm = llm_factory()
                self.engine = AsyncEngine(
                    llm.engine, max_waiting=max_waiting, replica=self.replica, sampling_defaults=llm.sampling_defaults
                )
            except BaseException as exc:  # noqa: BLE001 - reported to Ray as the constructor's failure
                failure.append(exc)
                return
            finally:
                loaded.set()
            self.engine.run()

        threading.Thread(target=load_and_run, name="specdecode-engine", daemon=True).start()
        loaded.wait()
        if failure:
            raise failure[0]
        threading.Thread(target=self._push_metrics, args=(hub,), daemon=True).start()

    def _push_metrics(self, hub) -> None:
        while True:
            hub.put.remote(self.replica, self.engine.metrics.render())
            time.sleep(METRICS_PUSH_SECONDS)

    def describe(self) -> dict:
        return {
            "tokenizer": self.engine.tokenizer,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "adapters": self.engine.adapters,
            "sampling_defaults": self.engine.sampling_defaults,
        }

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        timeout: float | None = None,
        session: str | None = None,
        tenant: str = "",
        adapter: str = "",
    ):
        """Streams the request's Updates; a refusal or failure arrives as an Update carrying the error."""
        try:
            handle = self.engine.submit(prompt_ids, params, tenant=tenant, adapter=adapter)
            async for update in self.engine.updates(handle, timeout):
                yield update
        except SpecDecodeError as exc:
            yield Update("", True, error=exc, replica=self.replica)

    def __del__(self):
        if self.engine is not None:
            self.engine.stop()


# ---- the ingress ------------------------------------------------------------------------------------
@dataclass
class RemoteRequest:
    prompt_ids: list[int]
    params: SamplingParams
    session: str | None
    streamed: bool
    tenant: str = ""
    adapter: str = ""


class RemoteEngines:
    """What build_app needs from an engine (see AsyncEngine), served by the replicas behind a handle.

    A request whose replica dies is retried on another while nothing of it has reached the client: a
    streamed request until its first update, a whole-response request at any point (its updates are held
    until it completes). Past that it ends with a 503 (ReplicaDied): streamed text cannot be taken back."""

    def __init__(self, handle, hub, described: dict, max_attempts: int = 3):
        self._handle = handle.options(stream=True)
        self._hub = hub
        self.tokenizer = described["tokenizer"]
        self.max_model_len = described["max_model_len"]
        self.vocab_size = described["vocab_size"]
        self.adapters = described["adapters"]
        self.sampling_defaults = described["sampling_defaults"]
        self.max_attempts = max_attempts

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
        streamed: bool = True,
        tenant: str = "",
        adapter: str = "",
    ) -> RemoteRequest:
        return RemoteRequest(prompt_ids, params, session, streamed, tenant, adapter)

    async def updates(self, request: RemoteRequest, timeout: float | None = None):
        for attempt in range(1, self.max_attempts + 1):
            produced, held = False, []
            stream = self._handle.generate.remote(
                request.prompt_ids,
                request.params,
                timeout,
                session=request.session,
                tenant=request.tenant,
                adapter=request.adapter,
            )
            try:
                async for update in stream:
                    if update.error is not None:
                        raise update.error
                    if not request.streamed:
                        held.append(update)
                        continue
                    produced = True
                    yield update
                for update in held:
                    yield update
                return
            except ray.exceptions.RayError as exc:  # the replica died (or became unreachable)
                if produced:
                    raise ReplicaDied(
                        "the engine replica serving this request died mid-stream; retry the request"
                    ) from exc
                if attempt == self.max_attempts:
                    raise ReplicaDied(f"{attempt} engine replicas failed this request in a row; retry later") from exc
            finally:
                stream.cancel()  # a client that left (or a failure) frees the replica's slot at once

    async def metrics_text(self) -> bytes:
        return merge_replica_metrics(await self._hub.live.remote())


class OpenAIIngress:
    async def __init__(
        self,
        engines,
        hub,
        model_name: str | list[str],
        api_key: str | None,
        max_request_bytes: int,
        request_timeout: float | None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
    ):
        described = await engines.describe.remote()
        self._app = build_app(
            RemoteEngines(engines, hub, described),
            model_name,
            api_key,
            max_request_bytes,
            runs_engine=False,
            request_timeout=request_timeout,
            reasoning_parser=reasoning_parser,
            trust_request_chat_template=trust_request_chat_template,
        )

    def __serve_build_asgi_app__(self):
        return self._app


# ---- building the application ------------------------------------------------------------------------
@dataclass
class RayDeployment:
    """What `serve --ray` (or a test) asks for. replicas: a fixed count, unless autoscaling bounds are set."""

    llm_factory: object  # a picklable callable returning an LLM, evaluated on each replica
    model_name: str | list[str]  # the names requests give it (the first in responses)
    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float | None = None
    max_ongoing_requests: int = 80  # per replica: its sequence slots plus its waiting queue
    max_waiting: int | None = 64
    api_key: str | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    request_timeout: float | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False

    def scaling(self) -> dict:
        if self.min_replicas is None and self.max_replicas is None:
            return {"num_replicas": self.replicas}
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        if not 0 <= low <= high or high < 1:
            raise SpecDecodeError(
                f"autoscaling needs 0 <= --min-replicas <= --max-replicas and at least one replica, got {low}..{high}"
            )
        config = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1)}
        if self.target_ongoing_requests is not None:
            config["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": config}

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def describe_scaling(self) -> str:
        scaling = self.scaling()
        if "num_replicas" in scaling:
            return f"{self.replicas} engine replicas"
        bounds = scaling["autoscaling_config"]
        return f"{bounds['min_replicas']}-{bounds['max_replicas']} engine replicas, autoscaled"

    def application(self, hub):
        resources = {"num_cpus": self.num_cpus_per_replica}
        if self.num_gpus_per_replica:
            resources["num_gpus"] = self.num_gpus_per_replica
        engines = (
            serve.deployment(EngineReplica)
            .options(
                name=ENGINE_DEPLOYMENT,
                ray_actor_options=resources,
                max_ongoing_requests=self.max_ongoing_requests,
                request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
                health_check_period_s=2,
                health_check_timeout_s=10,
                **self.scaling(),
            )
            .bind(self.llm_factory, hub, self.max_waiting)
        )
        ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(
            name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000
        )
        return ingress.bind(
            engines,
            hub,
            self.model_name,
            self.api_key,
            self.max_request_bytes,
            self.request_timeout,
            self.reasoning_parser,
            self.trust_request_chat_template,
        )


def run_deployment(deployment: RayDeployment, host: str, port: int, app_name: str = "specdecode"):
    """Start Serve's HTTP proxy on host:port and deploy; returns the MetricsHub handle (keep it alive)."""
    hub = MetricsHub.remote()
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment.application(hub), name=app_name, route_prefix="/")
    return hub
