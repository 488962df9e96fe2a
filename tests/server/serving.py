"""Run ``vllm-retro serve`` as a real subprocess on a free loopback port, for HTTP tests."""

from __future__ import annotations

import contextlib
import os
import re
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
class Server:
    """A started ``vllm-retro serve`` process, its URL and its log file."""

    proc: subprocess.Popen
    url: str
    log: Path
    descendants: list[psutil.Process] = field(default_factory=list)

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's combined stdout/stderr."""
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``/health`` answers 200; fail with the log if the process dies or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n"
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
        self.stop()
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def metrics(self) -> str:
        """The text of ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout_s: float = 10.0) -> float:
        """SIGTERM, then wait up to ``timeout_s``; returns the seconds it took. Kills the
        whole tree (and fails) if it does not stop in time."""
        if self.proc.poll() is not None:
            return 0.0
        tree = [psutil.Process(self.proc.pid), *self.descendants]
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            self.proc.wait(30)
            raise AssertionError(f"server still running {timeout_s} s after SIGTERM:\n"
                                 f"{self.log_tail()}") from None
        return time.monotonic() - t0

    def live_descendants(self, grace_s: float = 5.0) -> list[psutil.Process]:
        """Child processes seen while the server ran that are still alive (after waiting up
        to ``grace_s`` for them to exit)."""
        deadline = time.monotonic() + grace_s
        alive = self.descendants
        while time.monotonic() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.2)
        return alive


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """Start ``vllm-retro serve ARGS --port <free>`` with its output going to ``log``."""
    port = free_port()
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    out = log.open("w")
    proc = subprocess.Popen([str(CONSOLE_SCRIPT), "serve", *args, "--port", str(port)],
                            stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", log)


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` whose labels include ``labels`` (summed over the
    other labels); 0.0 when absent."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    return total if found else 0.0


def help_lines(metrics_text: str) -> dict[str, str]:
    """``# HELP`` text per family name."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("# HELP "):
            name, _, text = line[len("# HELP "):].partition(" ")
            out[name] = text
    return out
