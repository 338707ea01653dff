"""`specdecode serve`: load the models, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import signal
import threading
import time

from ..cli import engine_options, served_names
from ..config import LOSSY_NOTE, EngineConfig
from ..engine.llm import LLM
from ..errors import SpecDecodeError
from ..models.sources import served_draft
from .api import build_app
from .async_engine import AsyncEngine


def llm_options(args) -> dict:
    """LLM(...)'s arguments from serve's flags, checked: plain data, so that Ray can ship them to replicas."""
    options = engine_options(args)
    # k = 0: no draft to load or plan for
    options["speculative_model"] = (
        served_draft(args.model, args.speculative_model) if args.num_speculative_tokens else None
    )
    return EngineConfig(**options).as_dict()


def run_serve(args) -> int:
    import uvicorn

    if args.ray:
        from .ray_cmd import run_serve_ray

        if args.allow_runtime_lora_updating:
            raise SpecDecodeError("--allow-runtime-lora-updating loads adapters into one engine: leave out --ray")

        return run_serve_ray(args, llm_options(args))
    options = llm_options(args)
    llm = LLM(**options)
    _print_startup(llm, args)
    engine = AsyncEngine(llm.engine, max_waiting=args.max_waiting_requests, sampling_defaults=llm.sampling_defaults)
    app = build_app(
        engine,
        served_names(args),
        args.api_key,
        args.max_request_bytes,
        runs_engine=False,
        request_timeout=args.request_timeout,
        reasoning_parser=args.reasoning_parser,
        runtime_lora=args.allow_runtime_lora_updating,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    # HTTP in a thread, the engine loop on this (main) thread: see AsyncEngine.run
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)
    _drain_on_signals(engine, server, args.shutdown_grace)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise SpecDecodeError(f"the HTTP server did not start on {args.host}:{args.port} (is the port free?)")
        time.sleep(0.05)
    threading.Thread(target=lambda: (http.join(), engine.stop()), daemon=True).start()
    draft, names = options["speculative_model"] or "none", ", ".join(served_names(args))
    print(
        f"serving {args.model} as {names} (draft: {draft}, policy: {args.speculation_policy}) on "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    engine.run()
    return 0


def _print_startup(llm: LLM, args) -> None:
    print(llm.startup_summary(), flush=True)
    print(llm.memory_plan.summary(), flush=True)
    if llm.profile_seconds:
        slots = llm.engine.runner.num_slots
        print(
            f"timed the draft's forward for 1-{slots} sequences in {llm.profile_seconds:.1f} s (the adaptive "
            "policy's cost model)",
            flush=True,
        )
    if llm.sampling_defaults:
        given = ", ".join(f"{k}={v:g}" for k, v in llm.sampling_defaults.items())
        print(
            f"requests that leave them unset sample with the model's recommended {given} (its generation config; "
            "--generation-config vllm for none)",
            flush=True,
        )
    if args.forced_accept:
        print(f"WARNING: {LOSSY_NOTE}", flush=True)


def _drain_on_signals(engine: AsyncEngine, server, grace: float) -> None:
    """SIGTERM or SIGINT: new requests get 503 while the running ones have `grace` seconds to finish; then the
    rest are cancelled and the HTTP server stops. A second signal stops at once."""

    def drain_then_exit():
        cancelled = engine.drain(grace)
        if cancelled:
            print(
                f"shutdown: cancelled {len(cancelled)} request(s) still running after {grace:g} s: "
                f"{', '.join(cancelled)}",
                flush=True,
            )
        else:
            print("shutdown: every running request finished", flush=True)
        server.should_exit = True

    def shut_down(*_):
        if engine.draining:
            server.force_exit = server.should_exit = True
            return
        engine.draining = True
        print(f"shutdown: draining {engine.in_flight} running request(s) for up to {grace:g} s", flush=True)
        threading.Thread(target=drain_then_exit, daemon=True).start()

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
