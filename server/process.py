"""``vllm-retro serve`` as a child process on a free loopback port: start, wait until it
serves, read ``/metrics``, stop with SIGTERM. Used by the load benchmark and the HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CONSOLE_SCRIPT = Path(sys.executable).parent / "vllm-retro"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A started ``vllm-retro serve`` (its own process group), its URL and its log file."""

    proc: subprocess.Popen
    url: str
    log: Path
    descendants: list[psutil.Process] = field(default_factory=list)
    """Child processes (engine core, workers), recorded once the server is ready."""

    @classmethod
    def start(cls, args: list[str], log: Path, env: dict[str, str] | None = None
              ) -> ServerProcess:
        """Run ``vllm-retro serve ARGS --port <free>`` with its whole output (start-up log
        included) to ``log``; ``env`` is added to this process's environment."""
        port = free_port()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(CONSOLE_SCRIPT), "serve", *args, "--port", str(port),
                 "--startup-log", "full", "--log-file", str(log.with_suffix(".full.log"))],
                stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                start_new_session=True)
        return cls(proc, f"http://127.0.0.1:{port}", log)

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's combined stdout/stderr."""
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/health`` answers 200. Raises RuntimeError with the log tail if the
        process exits, or (after stopping it) if ``timeout_s`` seconds pass."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.descendants = psutil.Process(self.proc.pid).children(
                            recursive=True)
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def metrics(self) -> str:
        """The text of ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 10.0) -> float:
        """SIGTERM, then wait up to ``timeout_s``; returns the seconds the server took to
        exit. If it is still running then, kills its process group and raises TimeoutError."""
        if self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"server still running {timeout_s} s after SIGTERM:\n"
                               f"{self.log_tail()}") from None
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL the server's process group and wait for the server."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def live_descendants(self, grace_s: float = 5.0) -> list[psutil.Process]:
        """Child processes seen while the server ran that are still alive, after waiting up
        to ``grace_s`` for them to exit."""
        deadline = time.monotonic() + grace_s
        alive = self.descendants
        while time.monotonic() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.2)
        return alive
