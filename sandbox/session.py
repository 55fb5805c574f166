"""Long-lived sandboxed environment sessions speaking JSON lines, two backends, and a warm pool.

`Sandbox` is what every stage uses (load a module, call its methods, run a snippet); get one
with `open_session()`, which picks the backend by its `backend` argument: docker (the default) or
subprocess (the run config's `sandbox`).
  docker      `EnvSession`: one hardened container per session (no network, read-only root,
              a non-host uid, memory/CPU/pid limits). The only backend for untrusted code.
  subprocess  `SubprocessSession`: the same runner in a plain child process, for a machine
              without Docker, and only for environments that already passed the Docker verifier.
Either way one process runs the image's runner.py; the host writes one request per line to its
stdin and reads one reply per line from its stdout. Everything the code in it prints goes to
stderr, of which only a capped tail is kept. Any crash, hang, oversized or garbage reply becomes
a `SandboxError` with a `kind` and the stderr tail, and the process (container) is always removed.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pwd
import queue
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from trace_rl.sandbox.engine import DockerUnavailable, ensure_engine, ensure_image, runtime_files


class SandboxError(RuntimeError):
    """kind: timeout | crashed | oom | protocol | output_limit | env_error | episode_timeout | contract | refused"""

    def __init__(self, kind: str, message: str, stderr: str = "", traceback: str = ""):
        super().__init__(f"[{kind}] {message}" + (f"\n--- stderr tail ---\n{stderr[-2000:]}" if stderr else ""))
        self.kind, self.message, self.stderr, self.traceback = kind, message, stderr, traceback


@dataclass(frozen=True)
class SessionLimits:
    memory: str = "512m"
    cpus: float = 1.0
    pids: int = 128
    tmpfs_size: str = "64m"
    call_timeout_s: float = 10.0
    episode_timeout_s: float = 300.0
    max_reply_bytes: int = 4 << 20
    max_stderr_bytes: int = 8 << 20  # past this the container is killed: output_limit
    cpu_time_s: float = 3600.0  # subprocess backend: RLIMIT_CPU, CPU seconds over the session's whole life


SANDBOX_UID = 64917  # the image's user (sandbox/image/Dockerfile): a uid no host account should have


def sandbox_user() -> str:
    """uid:gid for containers; refuses to run as a uid that a host account owns (a file the
    container could write through a mount, or a process it could signal, would be that user's)."""
    try:
        owner = pwd.getpwuid(SANDBOX_UID).pw_name
    except KeyError:
        return f"{SANDBOX_UID}:{SANDBOX_UID}"
    raise RuntimeError(f"host account {owner!r} has uid {SANDBOX_UID}, the sandbox's uid; "
                       "change SANDBOX_UID in sandbox/session.py and the Dockerfile to a free one")


def docker_run_args(image: str, limits: SessionLimits, name: str) -> list[str]:
    """`docker run` for a session container, with the hardening every container gets: no network,
    read-only root with a small tmpfs, memory/CPU/pid limits, no capabilities or new privileges, a
    non-host uid, no IPC."""
    return ["docker", "run", "-i", "--rm", "--name", name, "--network", "none", "--read-only",
            "--memory", limits.memory, "--memory-swap", limits.memory, "--cpus", str(int(limits.cpus * 1e9) / 1e9),
            "--pids-limit", str(limits.pids), "--user", sandbox_user(), "--ipc", "none",
            "--tmpfs", f"/tmp:size={limits.tmpfs_size},mode=1777", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--log-driver", "none",
            "-e", f"TRACE_RL_MAX_REPLY={limits.max_reply_bytes}", image, "python3", "/opt/trace_rl/runner.py"]


MAX_DEPTH = 64  # nesting of a reply's JSON; deeper is a protocol error, not a RecursionError on the host


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth_ok(x, limit: int = MAX_DEPTH) -> bool:
    stack = [(x, 0)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return False
        if isinstance(node, (dict, list)):
            stack += [(v, d + 1) for v in (node.values() if isinstance(node, dict) else node)]
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


class Closing:
    """`with x:` ends in `x.close()`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class JsonLinesProcess(Closing, ABC):
    """The host side of a JSON-lines protocol with a child process (runner.py for both sandbox
    backends, a benchmark's worker): request ids, call/episode timeouts, reply and output caps,
    typed errors. Subclasses start the process (`_spawn`) and kill what it started (`_kill`)."""

    what = "process"  # in messages: "<what> exited with ..."

    def __init__(self, limits: SessionLimits):
        self.limits = limits
        self.proc = self._spawn()
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

    @abstractmethod
    def _spawn(self) -> subprocess.Popen:
        """Start the runner with pipes on stdin/stdout/stderr (bufsize=0)."""

    def _kill(self) -> None:
        """Kill the runner (a subclass first kills what it started); may run more than once, from any thread."""
        if self.proc.poll() is None:
            self.proc.kill()

    def _exit_kind(self, returncode: int | None) -> tuple[str, str] | None:
        """(kind, message) for a runner that died with `returncode`, when it is not a plain crash."""
        return None

    def _fail(self, kind: str, message: str) -> SandboxError:
        if self.failure is not None:
            return self.failure
        self.close()
        if kind == "crashed" and self._stderr_total > self.limits.max_stderr_bytes:
            kind, message = "output_limit", f"wrote over {self.limits.max_stderr_bytes} bytes of output"
        elif kind == "crashed" and (known := self._exit_kind(self.proc.returncode)):
            kind, message = known
        self.failure = SandboxError(kind, message, self.stderr)
        return self.failure

    def request(self, req: dict, timeout: float | None = None):
        if self.failure is not None:  # a dead session says why it died, not "exit 137"
            raise self.failure
        if self.proc.poll() is not None:
            raise self._fail("crashed", f"{self.what} exited with {self.proc.returncode}")
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
            raise self._fail("crashed", f"{self.what} exited with {self.proc.returncode}")
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
                raise self._fail("crashed", f"{self.what} exited with {self.proc.returncode}")
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

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _drain_stdout(self) -> None:
        """Read the protocol channel to its end: a module flooding it would otherwise block
        the container's removal (the engine waits for the attached stream). This thread owns
        the pipe from now on and closes it, so its fd number cannot be reused under it."""
        with suppress(OSError, ValueError):
            fd = self.proc.stdout.fileno()
            while os.read(fd, 1 << 20):
                pass
        with suppress(OSError):
            self.proc.stdout.close()

    def close(self) -> None:
        """Remove the process (container); at most ~2 s whatever the module is doing."""
        draining = self.proc.poll() is None
        if draining:
            threading.Thread(target=self._drain_stdout, daemon=True).start()
            killer = threading.Thread(target=self._kill, daemon=True)
            killer.start()
            killer.join(timeout=2)
            if self.proc.poll() is None:
                self.proc.kill()  # the docker client; the engine finishes removing the container on its own
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
        for f in (self.proc.stdin,) if draining else (self.proc.stdin, self.proc.stdout):
            with suppress(OSError):
                f.close()


class Sandbox(JsonLinesProcess):
    """A warm sandbox session: what the stages need, whichever backend runs it (a backend starts runner.py in
    `_spawn` and kills it in `_kill`). Every failure is a `SandboxError` with a kind (see there); a session
    whose process died is not `alive`, keeps raising its first failure, and is replaced, never reused.
    `close()` is quick and idempotent."""

    def load(self, code: str, entry: str = "Env", **kwargs) -> None:
        """Exec the module and build `entry(**kwargs)`; on failure the session is closed (a session
        that never loaded is useless)."""
        try:
            self.request({"op": "load", "code": code, "entry": entry, "kwargs": kwargs}, timeout=30)
        except SandboxError:
            self.close()
            raise

    def call(self, method: str, *args, **kwargs):
        """A method of the loaded object; its JSON result."""
        return self.request({"op": "call", "method": method, "args": list(args), "kwargs": kwargs})

    def exec(self, code: str, timeout: float | None = None) -> str:
        """Run a snippet in the sandbox; what it printed."""
        return self.request({"op": "exec", "code": code}, timeout=timeout)

    def new_episode(self) -> None:
        """Restart the per-episode wall clock (call before each reset)."""
        self._t_episode = time.monotonic()


class EnvSession(Sandbox):
    """The Docker backend: a warm hardened container (docker_run_args) that can load environment code and
    call methods on it. The one to use for code nobody has verified yet."""

    what = "container"

    def __init__(self, limits: SessionLimits = SessionLimits(), image: str | None = None):
        ensure_engine()
        self.name = f"trace-rl-env-{uuid.uuid4().hex[:12]}"
        self.image = image or ensure_image(log=lambda *a: None)
        super().__init__(limits)

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(docker_run_args(self.image, self.limits, self.name), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)

    def _kill(self) -> None:
        with suppress(subprocess.TimeoutExpired):
            subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)
        super()._kill()

    def _exit_kind(self, returncode):
        if returncode in (137, -9):
            return "oom", f"killed (exit {returncode}): memory limit {self.limits.memory} or killed"
        return None


def _size_bytes(size: str) -> int:
    """A docker size ("512m", "64m", "1g", "1048576") in bytes."""
    s = str(size).strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if s[-1:] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))


def _user_tasks() -> int | None:
    """Processes + threads this uid runs now (what RLIMIT_NPROC counts), or None if /proc says nothing."""
    uid, n = os.getuid(), 0
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    for pid in pids:
        with suppress(OSError):  # gone meanwhile
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
    return n or None


_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import runner; runner.main()"


@functools.lru_cache(maxsize=None)
def _namespace_args() -> tuple[str, ...] | None:
    """How this machine gives a child its own PID namespace (`unshare`, as root or through a user namespace),
    or None where it refuses both. A namespace is the one unprivileged way to end EVERY descendant: when its
    first process dies the kernel kills the rest, also one that called setsid or was double-forked, which a
    process-group kill misses."""
    for args in (("unshare", "--pid", "--fork", "--kill-child"),
                 ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child")):
        with suppress(OSError, subprocess.SubprocessError):
            if subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0:
                return args
    logging.getLogger(__name__).warning("no PID namespace here (unshare refused): a process a sandboxed module or a "
                                        "benchmark worker detaches with setsid may outlive it")
    return None


def contained(cmd: list[str], limits: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """`cmd` in a PID namespace of its own (see `_namespace_args`), with `limits` ({prlimit option: (soft,
    hard)}) set by util-linux's prlimit before `cmd` runs a line; falls back to `cmd` in a process group."""
    if limits and shutil.which("prlimit"):
        cmd = ["prlimit", *(f"--{name}={soft}:{hard}" for name, (soft, hard) in limits.items()), "--", *cmd]
    return [*(_namespace_args() or ()), "--", *cmd] if _namespace_args() else cmd


def _within_hard(which: int, soft: int, hard: int | None = None) -> tuple[int, int]:
    """(soft, hard) lowered to this process's own hard limit, which a child inherits and cannot exceed."""
    _, cur_hard = resource.getrlimit(which)
    hard = soft if hard is None else hard
    hard = hard if cur_hard == resource.RLIM_INFINITY else min(hard, cur_hard)
    return min(soft, hard), hard
_warned = False


class SubprocessSession(Sandbox):
    """The subprocess backend: the image's runner.py, same JSON-lines protocol, in a plain child
    process. For a machine without Docker (a GPU box for training), and ONLY for environments that
    already passed the verifier on the Docker backend: it is NOT isolation against hostile code.
    The module runs as this user, sees this user's files and the network, and can undo any of this.

    What it keeps of the Docker backend: the call/episode timeouts, the reply and output caps and
    the typed SandboxErrors (same host-side code); rlimits set on the child before any module code
    reaches it (address space = limits.memory, CPU seconds = limits.cpu_time_s, processes = what
    this uid runs now + limits.pids, file size = limits.tmpfs_size, no core files); its own session
    and process group, killed as one; a fresh temporary directory as cwd, HOME and TMPDIR, removed
    at close; an environment stripped to PATH/LANG; `python3 -I -S` (no site-packages, no PYTHON*
    variables) with only the image's files (runner.py, trace_env.py, reward.py, ...) on its path."""

    def __init__(self, limits: SessionLimits = SessionLimits()):
        global _warned
        if not _warned:
            _warned = True
            logging.getLogger(__name__).warning("sandbox backend 'subprocess': environment code runs without "
                                                "isolation (only for environments verified in Docker)")
        self.dir = Path(tempfile.mkdtemp(prefix="trace-rl-env-"))
        self.name = self.dir.name
        self.lib, self.work = self.dir / "lib", self.dir / "work"
        self.lib.mkdir()
        self.work.mkdir()
        for name, data in runtime_files().items():
            (self.lib / name).write_bytes(data)
        try:
            super().__init__(limits)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _spawn(self) -> subprocess.Popen:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": str(self.work), "TMPDIR": str(self.work),
               "TRACE_RL_MAX_REPLY": str(self.limits.max_reply_bytes)}
        # limits set by prlimit before the runner starts (not preexec_fn: that is unsafe in a host with
        # threads, as GRPO's is); the PID namespace takes every descendant with it at close
        cpu = max(1, int(self.limits.cpu_time_s))
        limits = {"as": _within_hard(resource.RLIMIT_AS, _size_bytes(self.limits.memory)),
                  "cpu": _within_hard(resource.RLIMIT_CPU, cpu, cpu + 5),  # SIGXCPU, then SIGKILL
                  "fsize": _within_hard(resource.RLIMIT_FSIZE, _size_bytes(self.limits.tmpfs_size)),
                  "core": (0, 0)}
        if os.geteuid() != 0 and (tasks := _user_tasks()) is not None:  # root ignores RLIMIT_NPROC
            limits["nproc"] = _within_hard(resource.RLIMIT_NPROC, tasks + self.limits.pids)
        return subprocess.Popen(contained([sys.executable, "-I", "-S", "-B", "-u", "-c", _BOOT, str(self.lib)], limits),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                                cwd=self.work, env=env, start_new_session=True, close_fds=True)

    def _kill(self) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the runner and whatever it started
        super()._kill()

    def _exit_kind(self, returncode):
        if returncode == -signal.SIGXCPU:
            return "timeout", f"killed (exit {returncode}): used its CPU time limit of {self.limits.cpu_time_s}s"
        if returncode == -signal.SIGKILL:
            return "oom", f"killed (exit {returncode}): the host's OOM killer, the CPU time limit or another process"
        return None

    def close(self) -> None:
        super().close()
        self._kill()  # also when the runner died first: what it forked may live on in its group
        shutil.rmtree(self.dir, ignore_errors=True)


BACKENDS = ("docker", "subprocess")


def backend_name(backend: str | None = None) -> str:
    """The sandbox backend: `backend`, else docker."""
    name = (backend or "docker").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"sandbox backend {name!r} (the run config's `sandbox`): use one of {', '.join(BACKENDS)}")
    return name


def open_session(limits: SessionLimits = SessionLimits(), backend: str | None = None,
                 image: str | None = None, verified: bool = False) -> Sandbox:
    """A started session on the chosen backend (`image`: the Docker image tag, when known).
    `verified`: the code it will run has passed the Docker verifier; only then may the subprocess
    backend (no isolation) run it. Model-written code nobody has verified runs in Docker or nowhere."""
    if backend_name(backend) == "subprocess":
        if not verified:
            raise SandboxError("refused", "the subprocess backend runs only environments verified in Docker: build "
                               "and verify where Docker runs (sandbox: docker there), then train here")
        return SubprocessSession(limits)
    return EnvSession(limits, image)


NO_NETWORK_PROBE = ("import socket, sys\n"
                    "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('NETWORK')\n"
                    "except OSError as e:\n    print('no network:', e)\n"
                    "print(sys.version.split()[0])\n")


def self_check() -> tuple[bool, str]:
    """Open a Docker session (engine started, image built if needed) and run the no-network probe
    through its `exec`: (ok, what it printed or why it failed). ok: Python ran and reached no network."""
    try:
        with EnvSession() as s:
            out = s.exec(NO_NETWORK_PROBE, timeout=30)
    except (SandboxError, DockerUnavailable, RuntimeError) as err:  # RuntimeError: a host account has SANDBOX_UID
        return False, str(err)
    return "NETWORK" not in out, out.strip()


class SessionPool(Closing):
    """Warm sessions with one environment loaded, so a GRPO group of 16 episodes does not
    pay 16 cold starts. A session that failed is replaced, never reused."""

    def __init__(self, code: str, size: int = 4, entry: str = "Env", limits: SessionLimits = SessionLimits(),
                 backend: str | None = None, verified: bool = False):
        self.code, self.entry, self.limits, self.verified = code, entry, limits, verified
        self.backend = backend_name(backend)
        self.image = ensure_image(log=lambda *a: None) if self.backend == "docker" else None
        self._free: queue.LifoQueue[Sandbox] = queue.LifoQueue()  # the warmest first
        self._all: list[Sandbox] = []
        self._lock = threading.Lock()
        for _ in range(size):
            self._free.put(self._new())

    def _new(self) -> Sandbox:
        s = open_session(self.limits, self.backend, image=self.image, verified=self.verified)
        s.load(self.code, self.entry)
        with self._lock:
            self._all.append(s)
        return s

    def acquire(self) -> Sandbox:
        """A warm session; a new one when all are in use (lockstep rollouts hold many at once)."""
        try:
            s = self._free.get_nowait()
        except queue.Empty:
            s = self._new()
        if not s.alive:
            s = self._new()
        s.new_episode()
        return s

    def release(self, s: Sandbox) -> None:
        self._free.put(s if s.alive else self._new())

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()
