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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise SpecDecodeError(f"`{' '.join(self.args)}` did not come up:\n{output[-2000:]}")
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


def llama_server(bin_dir: str, target: str, slots: int, context: int, threads: int,
                 draft: str | None = None, k: int = 4) -> ServerProcess:
    """llama.cpp's OpenAI-compatible server on a GGUF file: `slots` sequences of `context` tokens, batched
    continuously; with `draft`, its own draft-model speculation of up to k tokens."""
    from .llama_cpp import binary

    command = [binary(bin_dir, "llama-server"), "--host", "127.0.0.1", "-m", target, "-t", str(threads),
               "-np", str(slots), "-c", str(slots * context), "-cb"]
    if draft:
        command += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
    return ServerProcess([], command=command)
