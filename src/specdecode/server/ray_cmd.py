"""`specdecode serve --ray`: the same server, as engine replicas on Ray Serve (see ray_serve.py)."""

from __future__ import annotations

import functools
import os
import signal
import threading

from ..errors import SpecDecodeError


def build_replica_llm(options: dict, threads: int):
    """Runs on a replica: its torch threads match the CPUs Ray reserved for it."""
    import torch

    from ..engine.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(**options)
    print(llm.startup_summary(), flush=True)
    return llm


def run_serve_ray(args, options: dict) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecDecodeError("--ray needs Ray Serve: pip install 'specdecode[ray]'") from None
    from ..cli import served_names
    from .ray_serve import RayDeployment, run_deployment

    if args.replicas < 1:
        raise SpecDecodeError(f"--replicas must be at least 1, got {args.replicas}")
    deployment = RayDeployment(
        llm_factory=functools.partial(build_replica_llm, options, max(1, int(args.num_cpus_per_replica))),
        model_name=served_names(args),
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        num_cpus_per_replica=args.num_cpus_per_replica,
        num_gpus_per_replica=args.num_gpus_per_replica,
        max_ongoing_requests=args.max_num_seqs + args.max_waiting_requests,
        max_waiting=args.max_waiting_requests,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    deployment.scaling()  # bad bounds fail here, before a cluster starts
    if args.ray_address is None:
        needed = deployment.most_replicas * args.num_cpus_per_replica
        if needed > (os.cpu_count() or 1):
            raise SpecDecodeError(
                f"{deployment.most_replicas} replicas x {args.num_cpus_per_replica:g} CPUs need "
                f"{needed:g} CPUs and this machine has {os.cpu_count()}; lower --replicas or "
                "--num-cpus-per-replica"
            )
    ray.init(address=args.ray_address, include_dashboard=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        hub = run_deployment(deployment, args.host, args.port)  # noqa: F841 - kept alive while serving
        print(
            f"serving {args.model} on Ray Serve ({deployment.describe_scaling()}) at http://{args.host}:{args.port}/v1",
            flush=True,
        )
        stop.wait()
        print("shutdown: stopping the Ray Serve application", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
