"""Start-up supervision of ``vllm-retro serve``.

The command a user types runs this small supervisor (it imports neither torch nor vLLM). It
starts the real server (:func:`vllm_retro.server.cli.serve`) as a child process with all of
its output — its own, vLLM's, the engine-core and worker processes' — piped through here:

- every line goes to a log file (``--log-file``, default
  ``$VLLM_RETRO_CACHE/logs/serve-<time>.log``), named in the banner;
- until the server is ready, only vllm-retro's own lines reach the terminal (banner, model
  assembly, the KV-cache size); ``--startup-log full`` shows everything;
- once ``ready at`` is printed, everything is passed through (vLLM's request and stats logs)
  until a stop signal arrives; the shutdown's own logging then goes to the file only;
- if the server exits before it is ready, the root cause is read out of the log and printed as
  one or two plain lines plus the log's path, and the exit status is non-zero;
- if it exits on its own after it was ready (its engine died: a worker or the engine-core
  process killed, by the system's out-of-memory killer or anyone else, a crash, or a fatal
  error), the same: why, in one or two plain lines (:func:`death_summary`), the log's path, a
  non-zero status — so a process manager restarts it and its operator knows what to change;
  a server killed outright leaves its engine processes behind, holding the KV cache's memory
  and the output pipe: the supervisor stops them (:func:`_lines_until_exit`).

SIGTERM, SIGINT and SIGHUP are forwarded to the server, which drains and exits; the
supervisor then exits with its status. The server dies with the supervisor
(``PR_SET_PDEATHSIG``), so no engine process outlives a killed supervisor.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from vllm_retro import QUIET_TEARDOWN_ENV

CHILD_ENV = "VLLM_RETRO_SERVE_CHILD"
"""Set in the server process's environment: it runs the server instead of supervising."""

OWN_PREFIXES = ("vllm-retro:", "[vllm-retro]")
READY_MARK = "vllm-retro: ready at "
_OWN_ERROR = re.compile(r"^vllm-retro(?: serve)?: error: (.*)$")
"""vllm-retro's own fatal messages (and argparse's, whose prog is ``vllm-retro serve``)."""
STARTUP_LOG_CHOICES = ("brief", "full")

# A Python exception line as vLLM's processes print it, possibly behind its log prefixes
# "(Worker pid=123) " and "ERROR 11-23 08:26:39 [file.py:1063] ".
_EXC_LINE = re.compile(
    r"^(?:\([\w-]+(?: pid=\d+)?\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
    r"(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)$")
# Wrappers that only point at the real cause printed before them.
_WRAPPERS = ("Engine core initialization failed", "EngineDeadError", "see root cause",
             "See root cause", "Worker proc", "WorkerProc initialization failed",
             "Executor failed")

_HINTS = (
    (re.compile(r"Available memory on node|less than requested memory for kv|"
                r"Cannot allocate memory|out of memory", re.I),
     "not enough free memory for the model and its KV cache: free memory, or choose a smaller "
     "KV cache with --kv-cache-memory-bytes (e.g. 1G)"),
    (re.compile(r"Address already in use|Errno 98"),
     "the port is in use: stop the other server or pick another port with --port N"),
    (re.compile(r"max_model_len|max seq len|KV cache is needed", re.I),
     "the KV cache cannot hold one request of --max-model-len tokens: lower --max-model-len "
     "or raise --kv-cache-memory-bytes"),
)

_WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+|None)\)")
"""vLLM's executor's line when a worker process exits while the engine runs (the code is
None when it looked before the process was reaped)."""
_CORE_DIED = re.compile(r"engine core exited unexpectedly")
"""vLLM's client's line when the engine-core process ends while the server runs (killed, or
a crash that printed nothing)."""
_FATAL = re.compile(r"Fatal Python error: (.+)$")
"""Python's fault handler's line for a crash in native code (a segmentation fault, say)."""
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
"""Signals a process raises on itself when it crashes (not another's kill)."""
ORPHAN_GRACE_S = 5.0
"""Seconds the server's remaining processes get, once it has exited, before each signal."""
TAIL_LINES = 400
"""Log lines after ready kept in memory to explain an unexpected stop (the cause is near
the end)."""


def split_supervisor_options(argv: list[str]) -> tuple[list[str], Path | None, str]:
    """Remove ``--log-file PATH`` and ``--startup-log {brief,full}`` (either ``--x v`` or
    ``--x=v``) from a ``vllm-retro`` argument list; returns (rest, log_file, startup_log).
    Raises SystemExit with a one-line message for a bad value."""
    rest: list[str] = []
    log_file: Path | None = None
    startup = "brief"
    it = iter(argv)
    for a in it:
        name, eq, val = a.partition("=")
        if name in ("--log-file", "--startup-log"):
            if not eq:
                val = next(it, None)
                if val is None:
                    raise SystemExit(f"vllm-retro: {name} needs a value")
            if name == "--log-file":
                log_file = Path(val).expanduser()
            elif val in STARTUP_LOG_CHOICES:
                startup = val
            else:
                raise SystemExit(f"vllm-retro: --startup-log {val!r} is invalid; accepted: "
                                 f"{', '.join(STARTUP_LOG_CHOICES)}")
            continue
        rest.append(a)
    return rest, log_file, startup


KEEP_LOGS = 20
"""Default-location logs kept; older ones are removed when a server starts."""


def default_log_file() -> Path:
    """``$VLLM_RETRO_CACHE/logs/serve-<local time>-<pid>.log``; removes all but the newest
    :data:`KEEP_LOGS` - 1 earlier ones."""
    from vllm_retro.models import default_cache_dir

    logs = default_cache_dir() / "logs"
    old = sorted(logs.glob("serve-*.log"), key=lambda p: p.stat().st_mtime)
    for stale in old[: max(0, len(old) - (KEEP_LOGS - 1))]:
        stale.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return logs / f"serve-{stamp}-{os.getpid()}.log"


def _root_cause(line: str) -> str | None:
    """``"Type: message"`` when ``line`` is an exception line that is not only a wrapper
    pointing back at the real cause (:data:`_WRAPPERS`), else None."""
    m = _EXC_LINE.match(line.strip())
    if m is None or any(w in line for w in _WRAPPERS):
        return None
    return f"{m.group(1)}: {m.group(2)}"


def failure_summary(lines: Iterable[str]) -> list[str]:
    """One or two plain lines saying why a server that never became ready stopped, read from
    its log lines: vllm-retro's own error if it printed one, else the first root-cause
    exception (not the wrappers that only point back at it), with a hint for known causes."""
    own, causes = None, []
    for line in lines:
        line = line.rstrip("\n")
        m = _OWN_ERROR.match(line)
        if m:
            own = m.group(1)
        cause = _root_cause(line)
        if cause is not None:
            causes.append(cause)
    if own is not None:
        return [own]
    if not causes:
        return ["the server stopped before it was ready, without an error message"]
    cause = causes[0]
    for pattern, hint in _HINTS:
        if pattern.search(cause):
            return [hint, f"(vLLM said: {_shorten(cause)})"]
    return [_shorten(cause)]


def oom_kills() -> int | None:
    """Processes the kernel's out-of-memory killer has killed since boot (``oom_kill`` of
    ``/proc/vmstat``, Linux 4.13+), or None where that is not readable."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


_FREE_MEMORY = ("free memory, or restart with a smaller KV cache (--kv-cache-memory-bytes, "
                "e.g. 2G)")


def death_summary(lines: Iterable[str], oom_killed: bool, status: int) -> list[str]:
    """One or two plain lines saying why a server that was ready stopped without being asked
    to, from its log lines after ready. ``oom_killed``: the kernel's out-of-memory killer
    ran while it served (:func:`oom_kills` rose); ``status``: the server's exit status."""
    died, core_died, causes = None, False, []
    for line in lines:
        line = line.rstrip("\n")
        m = _WORKER_DIED.search(line)
        if m and died is None:
            died = (m.group(1), None if m.group(2) == "None" else int(m.group(2)))
        core_died = core_died or _CORE_DIED.search(line) is not None
        fatal = _FATAL.search(line)
        cause = f"Fatal Python error: {fatal.group(1)}" if fatal else _root_cause(line)
        if cause is not None:
            causes.append(cause)
    if died is None and core_died:
        said = "(vLLM said: engine core exited unexpectedly)"
        if oom_killed:
            return ["the engine-core process was killed by the system's out-of-memory killer "
                    f"(other programs took the memory left free at start): {_FREE_MEMORY}", said]
        if causes:
            return [f"the engine-core process failed: {_shorten(causes[0])}", said]
        return ["the engine-core process ended without an error message (killed by a signal, "
                "or a crash in native code)", said]
    if died is None and status < 0:  # the server's own (API) process, by a signal
        if oom_killed and -status == signal.SIGKILL:
            return ["the server's API process was killed by the system's out-of-memory killer "
                    f"(other programs took the memory left free at start): {_FREE_MEMORY}"]
        return [f"the server's API process {_how(-status)}"]
    if died is None:
        if oom_killed:  # the engine-core process itself, or one vLLM does not watch
            return [f"the system's out-of-memory killer ran while it served and the engine "
                    f"stopped: {_FREE_MEMORY}",
                    *([f"(vLLM said: {_shorten(causes[0])})"] if causes else [])]
        if causes:
            return [f"the engine failed: {_shorten(causes[0])}"]
        return [f"the server exited with status {status} without an error message"]
    name, code = died
    said = f"(vLLM said: worker {name} died unexpectedly, exit code {code})"
    if oom_killed and code in (None, -signal.SIGKILL):
        # (vLLM reads the code before the process is reaped at times: None)
        return ["a worker process was killed by the system's out-of-memory killer (other "
                f"programs took the memory left free at start): {_FREE_MEMORY}", said]
    if code is None:
        return ["a worker process died and the engine stopped with it", said]
    if code < 0:
        return [f"a worker process {_how(-code)} and the engine stopped with it", said]
    return [f"a worker process exited (status {code}) and the engine stopped with it"
            + (f": {_shorten(causes[0])}" if causes else ""), said]


def _how(signum: int) -> str:
    """How a process that ended by signal ``signum`` ended: "was killed (SIGKILL)", "crashed
    (SIGSEGV)"."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"{'crashed' if signum in _CRASHES else 'was killed'} ({name})"


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the supervisor dies (Linux), so nothing is orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    os.setpgrp()  # signals from the terminal reach the supervisor only, which forwards them


def _lines_until_exit(proc: subprocess.Popen) -> Iterator[str]:
    """The server's output lines until it has exited and nothing it started is left.

    The engine-core and worker processes write into the same pipe, so it ends only when the
    last of them exits; when the server itself is killed (by the out-of-memory killer, say)
    they would outlive it, serving nobody, holding the KV cache's memory, and keep the pipe
    open. So once the server has exited, whatever is left of its process group (they share
    it: :func:`_die_with_parent`) gets :data:`ORPHAN_GRACE_S` to finish, then SIGTERM, then
    SIGKILL."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="vllm-retro-output", daemon=True).start()
    exited_at, signals = None, [signal.SIGTERM, signal.SIGKILL]
    while True:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is None:
                continue
            now = time.monotonic()
            if exited_at is None:
                exited_at = now
            if now - exited_at < ORPHAN_GRACE_S:
                continue
            if not signals:  # the pipe stays open even after SIGKILL: a grandchild of theirs
                return
            try:
                os.killpg(proc.pid, signals.pop(0))
            except (ProcessLookupError, PermissionError):
                return
            exited_at = now
            continue
        if line is None:
            return
        yield line


def supervise(argv: list[str], out: IO[str] | None = None) -> int:
    """Run ``vllm-retro ARGV`` (a ``serve`` command) as a supervised child; returns the exit
    status to leave with. ``out`` is where the user's lines go (default stdout)."""
    out = out or sys.stdout
    argv, log_file, startup = split_supervisor_options(argv)
    log_file = log_file or default_log_file()
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log = log_file.open("w", buffering=1)
    except OSError as exc:
        print(f"vllm-retro: cannot write the log file {log_file}: {exc.strerror}; choose "
              "another with --log-file PATH", file=out, flush=True)
        return 2
    env = {**os.environ, CHILD_ENV: "1", QUIET_TEARDOWN_ENV: "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vllm_retro.server.cli", *argv]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True, errors="replace",
                            bufsize=1, preexec_fn=_die_with_parent)

    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if proc.poll() is None:
            if not stopping:
                print("vllm-retro: stopping (in-flight requests drain first)", file=out,
                      flush=True)
            stopping = True
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    print(f"vllm-retro: log {log_file}", file=out, flush=True)
    ready = False
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    kills_at_start = oom_kills()
    for line in _lines_until_exit(proc):
        log.write(line)
        own = line.startswith(OWN_PREFIXES) and not _OWN_ERROR.match(line)
        # vLLM's drain logs its own teardown (and, racily, an EngineDeadError traceback
        # when its client cancels the output task): after a stop signal only the log gets it
        # (once the server has exited, the lines of what it left behind go to the log only)
        if startup == "full" or own or (ready and not stopping and proc.poll() is None):
            out.write(line)
            out.flush()
        if ready:
            tail.append(line)
        elif line.startswith(READY_MARK):
            ready = True
    code = proc.wait()
    log.close()
    if ready and stopping:
        print(f"vllm-retro: stopped (log {log_file})", file=out, flush=True)
        return code if code >= 0 else 128 - code
    if ready:
        kills = oom_kills()
        oom = kills is not None and kills_at_start is not None and kills > kills_at_start
        reason = death_summary(tail, oom, code)
        lines = [f"vllm-retro: the server stopped unexpectedly: {reason[0]}", *reason[1:],
                 f"vllm-retro: full log: {log_file}"]
        print("\n".join(lines), file=out, flush=True)
        return code if code > 0 else 128 - code if code < 0 else 1
    if code == 0:  # e.g. --help
        return 0
    reason = failure_summary(log_file.read_text(errors="replace").splitlines())
    lines = [f"vllm-retro: the server did not start: {reason[0]}", *reason[1:],
             f"vllm-retro: full log: {log_file}"]
    print("\n".join(lines), file=out, flush=True)
    return code if code > 0 else 1
