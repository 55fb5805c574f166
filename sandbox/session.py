"""Long-lived sandboxed environment sessions speaking JSON lines, and a warm pool.

One container per session runs the image's runner.py; the host writes one request per
line to its stdin and reads one reply per line from its stdout. Everything the code in
the container prints goes to stderr, of which only a capped tail is kept. Any crash, hang,
oversized or garbage reply becomes a `SandboxError` with a `kind` and the stderr tail, and
the container is always removed.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass

from trace_rl.sandbox.engine import ensure_engine, ensure_image
from trace_rl.sandbox.run import Limits, cli_flags


class SandboxError(RuntimeError):
    """kind: timeout | crashed | oom | protocol | output_limit | env_error | episode_timeout | contract"""

    def __init__(self, kind: str, message: str, stderr: str = "", traceback: str = ""):
        super().__init__(f"[{kind}] {message}" + (f"\n--- stderr tail ---\n{stderr[-2000:]}" if stderr else ""))
        self.kind, self.stderr, self.traceback = kind, stderr, traceback


@dataclass(frozen=True)
class SessionLimits(Limits):
    call_timeout_s: float = 10.0
    episode_timeout_s: float = 300.0
    max_reply_bytes: int = 4 << 20
    max_stderr_bytes: int = 8 << 20  # past this the container is killed: output_limit


def docker_run_args(image: str, limits: Limits, name: str) -> list[str]:
    """`docker run` for a session container, with run.hardened's restrictions as flags."""
    return ["docker", "run", "-i", "--rm", "--name", name, *cli_flags(limits), "--log-driver", "none",
            "-e", f"TRACE_RL_MAX_REPLY={getattr(limits, 'max_reply_bytes', 4 << 20)}",
            image, "python3", "/opt/trace_rl/runner.py"]


MAX_DEPTH = 64  # nesting of a reply's JSON; deeper is a protocol error, not a RecursionError on the host


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth_ok(x, limit: int = MAX_DEPTH) -> bool:
    stack = [(x, 0)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return False
        if isinstance(node, dict):
            stack += [(v, d + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, d + 1) for v in node]
    return True


def parse_reply(line: bytes) -> dict:
    """One protocol line -> {"id", "ok": bool, ...}; ValueError says what is wrong with it."""
    try:
        reply = json.loads(line, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"reply nested deeper than {MAX_DEPTH}") from None
    except ValueError as err:
        raise ValueError(f"garbage on the protocol channel ({err})") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ValueError("a reply must be an object whose 'ok' is true or false")
    if not _depth_ok(reply):
        raise ValueError(f"reply nested deeper than {MAX_DEPTH}")
    return reply


class EnvSession:
    """A warm container that can load environment code and call methods on it."""

    def __init__(self, limits: SessionLimits = SessionLimits(), image: str | None = None):
        ensure_engine()
        self.limits = limits
        self.name = f"trace-rl-env-{uuid.uuid4().hex[:12]}"
        self.proc = subprocess.Popen(docker_run_args(image or ensure_image(log=lambda *a: None), limits, self.name),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0)
        self._stderr = bytearray()
        self._stderr_total = 0
        self._buf = b""
        self._t_episode = time.monotonic()
        self._next_id = 0
        self.failure: SandboxError | None = None  # the first failure: later calls report it, not a symptom
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        """Keep only a tail of stderr; past the cap, kill the container from another thread
        and keep draining, since a blocked pipe would stall the engine's removal."""
        killing = False
        while chunk := self.proc.stderr.read(65536):
            self._stderr_total += len(chunk)
            self._stderr += chunk
            del self._stderr[:-65536]
            if self._stderr_total > self.limits.max_stderr_bytes and not killing:
                killing = True
                threading.Thread(target=self._kill, daemon=True).start()

    @property
    def stderr(self) -> str:
        return bytes(self._stderr).decode(errors="replace")

    def _kill(self) -> None:
        try:
            subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.kill()

    def _fail(self, kind: str, message: str) -> SandboxError:
        if self.failure is not None:
            return self.failure
        self.close()
        if kind == "crashed" and self._stderr_total > self.limits.max_stderr_bytes:
            kind, message = "output_limit", f"wrote over {self.limits.max_stderr_bytes} bytes of output"
        elif kind == "crashed" and self.proc.returncode in (137, -9):
            kind, message = "oom", f"killed (exit {self.proc.returncode}): memory limit {self.limits.memory} or killed"
        self.failure = SandboxError(kind, message, self.stderr)
        return self.failure

    def request(self, req: dict, timeout: float | None = None):
        if self.failure is not None:  # a dead session says why it died, not "exit 137"
            raise self.failure
        if self.proc.poll() is not None:
            raise self._fail("crashed", f"container exited with {self.proc.returncode}")
        self._next_id += 1
        req = {**req, "id": self._next_id}
        timeout = timeout or self.limits.call_timeout_s
        remaining_episode = self.limits.episode_timeout_s - (time.monotonic() - self._t_episode)
        if remaining_episode <= 0:
            raise self._fail("episode_timeout", f"episode ran past {self.limits.episode_timeout_s}s")
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.proc.wait(timeout=10)
            raise self._fail("crashed", f"container exited with {self.proc.returncode}")
        deadline = time.monotonic() + min(timeout, remaining_episode)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail("timeout", f"no reply to {req.get('op')}/{req.get('method', '')} within {timeout}s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.proc.wait(timeout=10)
                raise self._fail("crashed", f"container exited with {self.proc.returncode}")
            self._buf += chunk
            if len(self._buf) > self.limits.max_reply_bytes + 1024:
                raise self._fail("output_limit", f"reply over {self.limits.max_reply_bytes} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = parse_reply(line)
        except ValueError as err:
            raise self._fail("protocol", f"{err}: {line[:200]!r}")
        if reply.get("id") != self._next_id:  # an extra or stale reply: this session is out of step for good
            raise self._fail("protocol", f"reply id {reply.get('id')!r} answers no request (expected {self._next_id})")
        if not reply["ok"]:
            raise SandboxError("env_error", f"{reply.get('error')}: {reply.get('message')}", self.stderr,
                               reply.get("traceback", ""))
        return reply.get("result")

    # -- the environment API
    def load(self, code: str, entry: str = "Env", **kwargs) -> None:
        """Load the module; on any failure the container is removed (a session that never loaded is useless)."""
        try:
            self.request({"op": "load", "code": code, "entry": entry, "kwargs": kwargs}, timeout=30)
        except SandboxError:
            self.close()
            raise
        self.loaded = (code, entry)

    def call(self, method: str, *args, **kwargs):
        return self.request({"op": "call", "method": method, "args": list(args), "kwargs": kwargs})

    def exec(self, code: str, timeout: float | None = None) -> str:
        return self.request({"op": "exec", "code": code}, timeout=timeout)

    def new_episode(self) -> None:
        """Restart the per-episode wall clock (call before each reset)."""
        self._t_episode = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _drain_stdout(self) -> None:
        """Read the protocol channel to its end: a module flooding it would otherwise block
        the container's removal (the engine waits for the attached stream). This thread owns
        the pipe from now on and closes it, so its fd number cannot be reused under it."""
        try:
            fd = self.proc.stdout.fileno()
            while os.read(fd, 1 << 20):
                pass
        except (OSError, ValueError):
            pass
        finally:
            try:
                self.proc.stdout.close()
            except OSError:
                pass

    def close(self) -> None:
        """Remove the container; at most ~2 s whatever the module is doing."""
        draining = False
        if self.proc.poll() is None:
            draining = True
            threading.Thread(target=self._drain_stdout, daemon=True).start()
            killer = threading.Thread(target=self._kill, daemon=True)
            killer.start()
            killer.join(timeout=2)
            if self.proc.poll() is None:
                self.proc.kill()  # the docker client; the engine finishes removing the container on its own
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdin,) if draining else (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SessionPool:
    """Warm sessions with one environment loaded, so a GRPO group of 16 episodes does not
    pay 16 cold starts. A session that failed is replaced, never reused."""

    def __init__(self, code: str, size: int = 4, entry: str = "Env", limits: SessionLimits = SessionLimits()):
        self.code, self.entry, self.limits = code, entry, limits
        self.image = ensure_image(log=lambda *a: None)
        self._free: queue.LifoQueue[EnvSession] = queue.LifoQueue()  # the warmest first
        self._all: list[EnvSession] = []
        self._lock = threading.Lock()
        for _ in range(size):
            self._free.put(self._new())

    def _new(self) -> EnvSession:
        s = EnvSession(self.limits, self.image)
        s.load(self.code, self.entry)
        with self._lock:
            self._all.append(s)
        return s

    def acquire(self) -> EnvSession:
        """A warm session; a new one when all are in use (lockstep rollouts hold many at once)."""
        try:
            s = self._free.get_nowait()
        except queue.Empty:
            s = self._new()
        if not s.alive:
            s = self._new()
        s.new_episode()
        return s

    def release(self, s: EnvSession) -> None:
        self._free.put(s if s.alive else self._new())

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
