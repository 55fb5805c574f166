"""One-shot sandboxed execution: the hardening every container gets."""
from __future__ import annotations

from dataclasses import dataclass

from trace_rl.sandbox.engine import ensure_image


@dataclass(frozen=True)
class Limits:
    memory: str = "512m"
    cpus: float = 1.0
    pids: int = 128
    tmpfs_size: str = "64m"
    timeout_s: float = 30.0
    max_output: int = 1 << 20  # bytes of stdout/stderr kept


SANDBOX_UID = 64917  # the image's user (sandbox/image/Dockerfile): a uid no host account should have


def sandbox_user() -> str:
    """uid:gid for containers; refuses to run as a uid that a host account owns (a file the
    container could write through a mount, or a process it could signal, would be that user's)."""
    import pwd

    try:
        owner = pwd.getpwuid(SANDBOX_UID).pw_name
    except KeyError:
        return f"{SANDBOX_UID}:{SANDBOX_UID}"
    raise RuntimeError(f"host account {owner!r} has uid {SANDBOX_UID}, the sandbox's uid; "
                       "change SANDBOX_UID in sandbox/run.py and the Dockerfile to a free one")


def hardened(limits: Limits) -> dict:
    """docker-py container options: no network, read-only root, no privileges, a non-host uid."""
    return dict(network_mode="none", read_only=True, tmpfs={"/tmp": f"size={limits.tmpfs_size},mode=1777"},
                mem_limit=limits.memory, memswap_limit=limits.memory, nano_cpus=int(limits.cpus * 1e9),
                pids_limit=limits.pids, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                user=sandbox_user(), ipc_mode="none")


def cli_flags(limits: Limits) -> list[str]:
    """The same hardening as `docker run` flags (sessions talk to the container over stdin)."""
    h = hardened(limits)
    flags = ["--network", h["network_mode"], "--read-only", "--memory", h["mem_limit"], "--memory-swap",
             h["memswap_limit"], "--cpus", str(h["nano_cpus"] / 1e9), "--pids-limit", str(h["pids_limit"]),
             "--user", h["user"], "--ipc", h["ipc_mode"]]
    flags += [f for path, opts in h["tmpfs"].items() for f in ("--tmpfs", f"{path}:{opts}")]
    flags += [f for cap in h["cap_drop"] for f in ("--cap-drop", cap)]
    flags += [f for opt in h["security_opt"] for f in ("--security-opt", opt)]
    return flags


@dataclass
class RunResult:
    exit_code: int | None  # None when killed on timeout
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
    """Run a Python snippet in a fresh hardened container; the container is always removed."""
    import requests

    from trace_rl.sandbox.engine import ensure_engine

    client = ensure_engine()
    container = client.containers.create(ensure_image(), ["python3", "-c", code], **hardened(limits))
    try:
        container.start()
        timed_out = False
        try:
            status = container.wait(timeout=limits.timeout_s)
            code_ = status.get("StatusCode")
        except (requests.exceptions.ConnectionError, requests.exceptions.ReadTimeout):
            container.kill()
            timed_out, code_ = True, None
        out = container.logs(stdout=True, stderr=False, tail=2000)[-limits.max_output:].decode(errors="replace")
        err = container.logs(stdout=False, stderr=True, tail=2000)[-limits.max_output:].decode(errors="replace")
        container.reload()
        oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
        return RunResult(code_, out, err, timed_out, oom)
    finally:
        container.remove(force=True)
