"""Start `specdecode serve` (or llama.cpp's llama-server, a peer to compare with) in a child process on a
free 127.0.0.1 port, wait until it answers, stop it with SIGTERM. Used by the benchmark sweeps and the
tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from ..errors import SpecDecodeError
from .llama_cpp import NO_REPACK_NOTE, binary


class ServerCrashed(SpecDecodeError):
    """The server process died of a signal before it answered."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(
    model: str,
    max_num_seqs: int,
    max_model_len: int | None,
    dtype: str,
    *,
    device: str | None = None,
    quantization: str | None = None,
    draft_quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    draft: str | None = None,
    k: int = 0,
    policy: str = "fixed",
    disable_by_batch_size: int = 0,
    forced_accept: bool = False,
    prompt_lookup: str | None = None,
    suffix_cache_scope: str | None = None,
) -> list[str]:
    """`specdecode serve` flags for one configuration, k = 0 being plain decoding; options left at their
    defaults are left out, so the server's own defaults apply (the default draft model, for one)."""
    argv = [
        "--model",
        model,
        "--max-num-seqs",
        str(max_num_seqs),
        *_option("--max-model-len", max_model_len),
        "--dtype",
        dtype,
        *_option("--device", device),
        *_option("--quantization", quantization),
        *_option("--draft-quantization", draft_quantization),
        *_option("--kv-cache-dtype", kv_cache_dtype),
    ]
    if k == 0:
        return argv + ["--num-speculative-tokens", "0"]
    return (
        argv
        + [
            *_option("--speculative-model", draft),
            "-k",
            str(k),
            "--policy",
            policy,
            *_option("--speculative-disable-by-batch-size", disable_by_batch_size),
        ]
        + (["--forced-accept"] if forced_accept else [])
        + ["--prompt-lookup", prompt_lookup or "none"]
        + _option("--suffix-cache-scope", suffix_cache_scope)
    )


def _option(flag: str, value) -> list[str]:
    """The flag and its value, or nothing for an unset value (None, "" or 0)."""
    return [flag, str(value)] if value else []


class ServerProcess:
    def __init__(self, serve_args: list[str], startup_timeout_s: float = 600, command: list[str] | None = None):
        """serve_args for `specdecode serve`; or `command`, any server's argv that takes `--port`."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        base = command or [sys.executable, "-m", "specdecode.cli", "serve", *serve_args]
        self.args = [*base, "--port", str(self.port)]
        self.startup_timeout_s = startup_timeout_s
        self.log = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            return self._wait_until_it_answers()
        except BaseException:  # SIGTERM or Ctrl-C while it starts: __exit__ will not run, so stop it here
            self.stop()
            raise

    def _wait_until_it_answers(self) -> "ServerProcess":
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            exited = self.proc.poll()
            if exited is not None or time.monotonic() > deadline:
                output = self.output()
                error = ServerCrashed if exited is not None and exited < 0 else SpecDecodeError
                raise error(f"`{' '.join(self.args)}` did not come up:\n{output[-2000:]}")
            time.sleep(0.5)

    def output(self) -> str:
        """What the server printed so far (pread: the shared file offset the child writes at stays put)."""
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()


class LlamaServerProcess(ServerProcess):
    """llama-server, started again with repacking off where its repacked batch kernels crash it during
    start-up (its warm-up forward is over several tokens; see llama_cpp.NO_REPACK_NOTE)."""

    repacked = True

    def __enter__(self) -> "LlamaServerProcess":
        try:
            return super().__enter__()
        except ServerCrashed:
            self.repacked = False
            self.args[-2:-2] = ["--no-repack"]  # before --port N
            print(f"note: {NO_REPACK_NOTE} (llama-server)", flush=True)
            return super().__enter__()


def llama_server(
    bin_dir: str,
    target: str,
    slots: int,
    context: int,
    threads: int,
    draft: str | None = None,
    k: int = 4,
    extra: tuple[str, ...] = (),
) -> LlamaServerProcess:
    """llama.cpp's OpenAI-compatible server on a GGUF file: `slots` sequences of `context` tokens, batched
    continuously; with `draft`, its own draft-model speculation of up to k tokens; `extra`: more of its options."""
    command = [
        binary(bin_dir, "llama-server"),
        "--host",
        "127.0.0.1",
        "-m",
        target,
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * context),
        "-cb",
    ]
    if draft:
        command += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
    return LlamaServerProcess([], command=[*command, *extra])
