"""The two sandbox backends behind one interface: the subprocess backend (a GPU machine without
Docker, for environments already verified in Docker) gives the Docker backend's results on a
library environment and the same typed SandboxErrors."""
import os
import time
from importlib import resources

import pytest

from processes import DETACH, alive_when
from trace_rl.sandbox.session import (EnvSession, Sandbox, SandboxError, SessionLimits, SessionPool,
                                      SubprocessSession, backend_name, open_session)

LIMITS = SessionLimits(call_timeout_s=2.0)
ENV = (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()
SEEDS = range(5)


def hostile(body: str) -> str:
    return "class Env:\n    def attack(self):\n" + "".join(f"        {l}\n" for l in body.splitlines())


def play(session: Sandbox) -> dict:
    """Per seed: the reset observation, the reference solution's reward, the do-nothing reward."""
    from trace_rl.agents.verifier import do_nothing, run_actions, solver
    from trace_rl.sandbox import contract

    session.load(ENV)
    out = {}
    for seed in SEEDS:
        session.new_episode()
        obs = contract.reset(session, seed)
        solved, _ = run_actions(session, seed, solver(session))
        idle, _ = run_actions(session, seed, do_nothing)
        out[seed] = {"obs": obs, "solver": solved, "do_nothing": idle}
    return out


def test_open_session_picks_the_backend():
    assert backend_name() == "docker" and backend_name("subprocess") == "subprocess"
    with open_session(LIMITS, "subprocess", verified=True) as s:
        assert isinstance(s, SubprocessSession) and isinstance(s, Sandbox)
    with pytest.raises(SandboxError, match="only environments verified in Docker"):
        open_session(LIMITS, "subprocess")  # code nobody verified never runs unisolated
    with pytest.raises(ValueError, match="sandbox backend 'chroot'"):
        backend_name("chroot")


def test_the_image_carries_the_reward_module():
    from trace_rl.sandbox.engine import _recipe_files, runtime_files

    core = (resources.files("trace_rl.core") / "reward.py").read_bytes()
    assert _recipe_files()["reward.py"] == core  # in the build context, so in the tag's hash
    assert {"runner.py", "trace_env.py", "reward.py"} <= set(runtime_files()) and "Dockerfile" not in runtime_files()
    dockerfile = (resources.files("trace_rl.sandbox") / "image" / "Dockerfile").read_text()
    assert "reward.py" in next(l for l in dockerfile.splitlines() if l.startswith("COPY"))


@pytest.mark.docker
def test_subprocess_backend_matches_docker_on_a_library_env(sandbox_image):
    with EnvSession(LIMITS, sandbox_image) as d:
        docker = play(d)
    with SubprocessSession(LIMITS) as s:
        sub = play(s)
    assert sub == docker
    assert all(r["solver"]["success"] and r["solver"]["reward"] == 1.0 for r in sub.values())
    assert all(not r["do_nothing"]["success"] for r in sub.values())


@pytest.mark.docker
def test_the_verifier_runs_in_docker_only(sandbox_image, monkeypatch):
    """The verifier is what makes code safe to run unisolated: it never runs unisolated itself (it takes no
    backend; the run config's `sandbox` reaches training and evaluation only)."""
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks
    from trace_rl.sandbox import contract, session

    with SubprocessSession(LIMITS) as s:  # the env's own tools stand in for the target's (same schemas)
        s.load(ENV)
        tools = contract.reset(s, 0)["tools"]
    monkeypatch.setattr(session, "SubprocessSession", None)  # any use of the unisolated backend would fail
    findings, _ = automatic_checks(ENV, tools, VerifyConfig(seeds=8, determinism_seeds=2))
    assert all(f.passed for f in findings), [f for f in findings if not f.passed]


def test_subprocess_round_trip_env_error_and_exec():
    with SubprocessSession(LIMITS) as s:
        s.load("class Env:\n    def ping(self, x):\n        print('noise')\n        return {'pong': x}\n")
        assert s.call("ping", 3) == {"pong": 3}
        deadline = time.monotonic() + 5  # stderr is drained by a thread: it may land just after the reply
        while "noise" not in s.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "noise" in s.stderr
        with pytest.raises(SandboxError) as info:
            s.call("missing")
        assert info.value.kind == "env_error" and "AttributeError" in str(info.value)
        out = s.exec("import os, sys\nprint(os.getcwd()); print(sorted(os.environ)); print(sys.flags.isolated)")
        cwd, env, isolated = out.splitlines()
        assert cwd == str(s.work) and "HOME" in env and "PYTHONPATH" not in env and isolated == "1"
        assert s.call("ping", "still alive") == {"pong": "still alive"}
    assert not s.alive and not s.dir.exists()


def test_subprocess_timeout_is_typed_and_the_process_goes():
    with SubprocessSession(LIMITS) as s:
        s.load(hostile("while True:\n    pass"))
        t0 = time.monotonic()
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert info.value.kind == "timeout" and time.monotonic() - t0 < 10
        assert not s.alive
        with pytest.raises(SandboxError) as again:  # a dead session keeps saying why it died
            s.call("attack")
        assert again.value is info.value
    assert not s.dir.exists()


def test_subprocess_crash_is_typed():
    with SubprocessSession(LIMITS) as s:
        s.load(hostile("import os\nos._exit(3)"))
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert info.value.kind == "crashed" and "exited with 3" in str(info.value) and not s.alive
    with pytest.raises(SandboxError) as info:  # a module that does not load
        with SubprocessSession(LIMITS) as s:
            s.load("import os\nos._exit(1)\n")
    assert info.value.kind == "crashed" and not s.alive


def test_subprocess_limits_output_memory_and_files():
    limits = SessionLimits(call_timeout_s=5, memory="256m", max_stderr_bytes=1 << 20, tmpfs_size="1m")
    with SubprocessSession(limits) as s:
        s.load(hostile("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))"))
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert info.value.kind == "output_limit"
    with SubprocessSession(limits) as s:
        s.load(hostile("x = []\nwhile True:\n    x.append(bytearray(50_000_000))"))
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert info.value.kind in ("oom", "env_error", "crashed") and "MemoryError" in str(info.value)
    with SubprocessSession(limits) as s:
        s.load(hostile("open('big', 'wb').write(b'x' * (2 << 20))"))
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert info.value.kind == "env_error" and "File too large" in str(info.value)


def test_subprocess_pool_replaces_dead_sessions():
    code = "class Env:\n    def ping(self, x):\n        return x\n    def die(self):\n        import os; os._exit(3)\n"
    with SessionPool(code, size=1, limits=LIMITS, verified=True, backend="subprocess") as pool:
        assert pool.image is None
        a = pool.acquire()
        assert isinstance(a, SubprocessSession) and a.call("ping", 1) == 1
        with pytest.raises(SandboxError) as info:
            a.call("die")
        assert info.value.kind == "crashed"
        pool.release(a)
        b = pool.acquire()
        assert b is not a and b.call("ping", 2) == 2
        pool.release(b)
    assert not any(os.path.exists(s.dir) for s in (a, b))


def test_no_process_a_module_detaches_outlives_its_subprocess_session():
    """A module that starts a setsid'd child and a double-forked daemon: both are gone once the session
    closes (its PID namespace), where a process-group kill would leave them running."""
    import uuid

    marker = f"trace-rl-detached-{uuid.uuid4().hex[:8]}"
    s = SubprocessSession(LIMITS)
    try:
        assert "spawned" in s.exec(DETACH.format(marker=marker), timeout=20)
        assert len(alive_when(marker, lambda n: n >= 2, 10)) == 2
    finally:
        s.close()
    assert alive_when(marker, lambda n: n == 0, 5) == []
