"""A long prompt (standard-library source) through `specdecode serve` on its default settings, then a second
request that starts with the same prompt: each one's time, prompt tokens found cached and the server's peak
resident memory.

    python tools/serve_long_prompt.py --tokens 32000
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request

from specdecode.bench.datasets import prompts_for
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_TARGET

PORT = 8123


def wait_for(server: subprocess.Popen) -> None:
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            return
        except OSError:
            if server.poll() is not None:
                sys.exit(server.stdout.read())
            time.sleep(2)


def complete(prompt: str, max_tokens: int) -> tuple[dict, float]:
    body = json.dumps({"model": DEFAULT_TARGET, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    reply = json.load(urllib.request.urlopen(request, timeout=3600))
    return reply, time.perf_counter() - start


def peak_rss_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    print(describe_machine(machine_info()))
    prompt = prompts_for(f"stdlib:{args.tokens}", 1, DEFAULT_TARGET)[0]
    server = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(PORT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(server)
        for label, text in (
            ("the prompt", prompt),
            ("the same prompt + a question", prompt + "\n# What does the code above do?\n"),
        ):
            reply, seconds = complete(text, args.max_tokens)
            usage = reply["usage"]
            print(
                f"{label}: {usage['prompt_tokens']} prompt tokens, {usage['prompt_tokens_details']['cached_tokens']}"
                f" cached, {usage['completion_tokens']} generated in {seconds:.1f} s; server peak RSS "
                f"{peak_rss_gib(server.pid):.2f} GiB"
            )
            print("  ", repr(reply["choices"][0]["text"][:120]))
    finally:
        server.send_signal(signal.SIGTERM)
        print("server log:\n" + server.communicate(timeout=120)[0])


if __name__ == "__main__":
    main()
