"""Ray Serve: a local Ray cluster on 127.0.0.1, two engine replicas of a tiny model behind one OpenAI
ingress. The openai client works unchanged, greedy outputs equal a single engine's, a session stays on
one replica, the metrics endpoint carries both replicas and its counters add up, and killing a replica
during a bounded load loses no request silently. Marked `ray` (a separate stage of `make test`)."""

import concurrent.futures
import functools
import os
import re

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
from conftest import tiny_llm, wait_until  # noqa: E402
from ray import serve  # noqa: E402

from specdecode import SamplingParams, SpecDecodeError  # noqa: E402
from specdecode.bench.server_process import free_port  # noqa: E402
from specdecode.server.ray_serve import ENGINE_DEPLOYMENT, RayDeployment, run_deployment  # noqa: E402

pytestmark = pytest.mark.ray
API_KEY = "ray-key"


@pytest.fixture(scope="module")
def cluster():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": tests_dir}}
    )  # replicas import conftest's tiny_llm
    port = free_port()
    deployment = RayDeployment(
        llm_factory=functools.partial(tiny_llm),
        model_name="tiny",
        replicas=2,
        num_cpus_per_replica=0.5,
        api_key=API_KEY,
    )
    hub = run_deployment(deployment, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    yield url, openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0), hub
    serve.shutdown()
    ray.shutdown()


def _single_engine(prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return tiny_llm().generate(prompt, params)[0].outputs[0].text


def test_openai_client_unchanged_and_greedy_equals_one_engine(cluster):
    _, client, _ = cluster
    for prompt in ("hello world", "abcabcabc"):
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == _single_engine(prompt, 20)
        assert r.usage.completion_tokens == 20 and r.usage.model_extra["speculation"]["num_draft_tokens"] > 0
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, n=2
    )
    assert len(chat.choices) == 2 and len(chat.choices[0].logprobs.content) <= 5


def test_errors_and_api_key_as_in_one_engine(cluster):
    url, _, _ = cluster
    bad = httpx.post(
        f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401


def _replica(client: openai.OpenAI, **request) -> str:
    return client.completions.create(model="tiny", prompt="s", max_tokens=2, **request).usage.model_extra["replica"]


def test_a_session_stays_on_one_replica_and_sessions_spread(cluster):
    """Sessions spread only over the replicas the router knows: requests without one (to the less loaded of two)
    first show that it routes to both. 16 sessions all ranked to one of two replicas: a chance of 2^-15."""
    _, client, _ = cluster
    seen: set[str] = set()
    wait_until(lambda: seen.add(_replica(client)) or len(seen) == 2, "requests reach both replicas")
    placed: dict[str, set] = {}
    for session in [f"user-{i}" for i in range(16)] * 3:
        placed.setdefault(session, set()).add(_replica(client, user=session))
    assert all(len(replicas) == 1 for replicas in placed.values())
    assert len(set().union(*placed.values())) == 2


def _by_replica(url: str, metric: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(metric + r'\{replica="([^"]+)"\} ([0-9.e+]+)', text)}


def _draft_tokens_by_replica(url: str) -> dict[str, float]:
    return _by_replica(url, "specdecode_spec_decode_num_draft_tokens_total")


def _pushed_twice_more(hub) -> None:
    """Until each replica has pushed twice more (the first may have been rendered before this call): its
    metrics then count every request finished before it."""
    start = ray.get(hub.pushes.remote())
    wait_until(
        lambda: (
            len(now := ray.get(hub.pushes.remote())) == 2
            and all(n >= start.get(replica, 0) + 2 for replica, n in now.items())
        ),
        "both replicas pushed their metrics",
        timeout=30,
        every=0.1,
    )


def test_metrics_carry_both_replicas_and_add_up(cluster):
    url, client, hub = cluster
    _pushed_twice_more(hub)
    before = _draft_tokens_by_replica(url)
    drafted = 0
    for i in range(8):
        r = client.completions.create(
            model="tiny",
            prompt=f"m{i}",
            max_tokens=12,
            temperature=0,
            user=f"metrics-{i}",
            extra_body={"ignore_eos": True},
        )
        drafted += r.usage.model_extra["speculation"]["num_draft_tokens"]
    assert drafted > 0
    _pushed_twice_more(hub)
    after = _draft_tokens_by_replica(url)
    assert len(after) == 2
    assert sum(after.values()) - sum(before.values()) == drafted


def _two_replicas_run() -> bool:
    app = serve.status().applications.get("specdecode")
    running = app and app.deployments[ENGINE_DEPLOYMENT].replica_states.get("RUNNING", 0)
    return running == 2 and len(_engine_replicas()) == 2


def _engine_replicas() -> list[tuple[str, str]]:
    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if ENGINE_DEPLOYMENT in a["name"]
    ]


def test_killing_a_replica_during_load_loses_no_request(cluster):
    """Whole-response requests are retried on the other replica; a streamed one that had started gets an
    error event naming the dead replica; none hangs or vanishes."""
    url, _, _ = cluster
    body = {"model": "tiny", "prompt": "load", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def whole(i):
        r = httpx.post(f"{url}/v1/completions", json={**body, "user": f"kill-{i}"}, headers=auth, timeout=120)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.json()['error']['message']}"
        return "ok" if r.json()["usage"]["completion_tokens"] == 200 else "wrong length"

    def streamed(i):
        text = httpx.post(
            f"{url}/v1/completions", json={**body, "user": f"kill-s{i}", "stream": True}, headers=auth, timeout=120
        ).text
        if '"completion_tokens": 200' in text:
            return "ok"
        return "replica error" if "replica" in text and text.rstrip().endswith("data: [DONE]") else text[-300:]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(whole, i) for i in range(16)] + [pool.submit(streamed, i) for i in range(8)]
        wait_until(
            lambda: sum(_by_replica(url, "specdecode_num_requests_running").values()) > 0,
            "the replicas run the load",
            timeout=60,
            every=0.1,
        )
        name, namespace = _engine_replicas()[0]
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        outcomes = [f.result(timeout=180) for f in futures]
    assert outcomes[:16] == ["ok"] * 16
    assert set(outcomes[16:]) <= {"ok", "replica error"}, outcomes[16:]
    wait_until(_two_replicas_run, "Ray Serve replaced the killed replica", timeout=120, every=1)
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 5}, headers=auth, timeout=60)
    assert r.status_code == 200


def test_scaling_options():
    base = dict(llm_factory=tiny_llm, model_name="tiny")
    assert RayDeployment(**base, replicas=3).scaling() == {"num_replicas": 3}
    auto = RayDeployment(**base, min_replicas=1, max_replicas=4, target_ongoing_requests=2).scaling()
    assert auto == {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 4,
            "initial_replicas": 1,
            "target_ongoing_requests": 2,
        }
    }
    with pytest.raises(SpecDecodeError, match="min-replicas <= --max-replicas"):
        RayDeployment(**base, min_replicas=3, max_replicas=1).scaling()


def test_merged_metrics_label_each_replica():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from specdecode.server.replica_metrics import merge_replica_metrics

    texts = {}
    for replica, n in (("a", 3), ("b", 4)):
        registry = CollectorRegistry()
        Counter("specdecode_x", "x", registry=registry).inc(n)
        texts[replica] = generate_latest(registry)
    merged = merge_replica_metrics(texts).decode()
    assert 'specdecode_x_total{replica="a"} 3.0' in merged and 'specdecode_x_total{replica="b"} 4.0' in merged
    assert merged.count("# TYPE specdecode_x_total counter") == 1  # one family, as one engine writes it
