"""Hostile environment code: each attack is stopped or contained and reported as a typed
SandboxError; the host and later sessions are unaffected."""
import subprocess
import time
import uuid

import pytest

from trace_rl.sandbox.session import EnvSession, SandboxError, SessionLimits, SessionPool

pytestmark = [pytest.mark.docker, pytest.mark.ci, pytest.mark.slow]

LIMITS = SessionLimits(call_timeout_s=5, memory="256m", pids=64, max_stderr_bytes=4 << 20)
OK_ENV = "class Env:\n    def ping(self, x):\n        return {'pong': x}\n"


def hostile(body: str) -> str:
    return "class Env:\n    def attack(self):\n" + "".join(f"        {l}\n" for l in body.splitlines())


def attack(sandbox_image, body: str, limits=LIMITS) -> SandboxError:
    with EnvSession(limits, sandbox_image) as s:
        s.load(hostile(body))
        t0 = time.monotonic()
        with pytest.raises(SandboxError) as info:
            s.call("attack")
        assert time.monotonic() - t0 < 60
    assert not _containers(s.name), "container left behind"
    return info.value


def _containers(name: str) -> str:
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"name={name}"], capture_output=True, text=True).stdout.strip()


def test_round_trip_and_env_errors(sandbox_image):
    with EnvSession(LIMITS, sandbox_image) as s:
        s.load(OK_ENV)
        assert s.call("ping", 3) == {"pong": 3}
        with pytest.raises(SandboxError) as info:
            s.call("missing")
        assert info.value.kind == "env_error" and "AttributeError" in str(info.value)
        assert s.call("ping", "still alive") == {"pong": "still alive"}


def test_infinite_loop_times_out(sandbox_image):
    assert attack(sandbox_image, "while True:\n    pass").kind == "timeout"


def test_fork_bomb_is_contained(sandbox_image):
    err = attack(sandbox_image, "import os\nwhile True:\n    os.fork()")
    assert err.kind in ("env_error", "timeout", "crashed")


def test_memory_balloon_is_killed(sandbox_image):
    err = attack(sandbox_image, "x = []\nwhile True:\n    x.append(bytearray(50_000_000))")
    assert err.kind in ("oom", "env_error", "crashed")  # MemoryError inside, or the OOM killer


def test_network_is_unreachable(sandbox_image):
    err = attack(sandbox_image, "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)")
    assert err.kind == "env_error" and ("unreachable" in str(err).lower() or "Errno" in str(err))


def test_root_filesystem_is_read_only(sandbox_image):
    err = attack(sandbox_image, "open('/opt/trace_rl/pwned', 'w').write('x')")
    assert err.kind == "env_error" and "Read-only file system" in str(err)
    with EnvSession(LIMITS, sandbox_image) as s:  # tmpfs is writable
        s.load("class Env:\n    def w(self):\n        open('/tmp/a', 'w').write('ok'); return open('/tmp/a').read()\n")
        assert s.call("w") == "ok"


def test_printing_a_gigabyte_hits_the_output_cap(sandbox_image):
    err = attack(sandbox_image, "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))")
    assert err.kind == "output_limit"


def test_garbage_on_the_protocol_channel(sandbox_image):
    err = attack(sandbox_image, "import os, json\nos.write(3, b'not json\\n')\nimport time; time.sleep(5)")
    assert err.kind in ("protocol", "env_error", "timeout")


def test_host_files_are_invisible(sandbox_image, tmp_path):
    marker = f"/tmp/trace-rl-host-secret-{uuid.uuid4().hex}"
    open(marker, "w").write("secret")
    err = attack(sandbox_image, f"print(open({marker!r}).read())")
    assert err.kind == "env_error" and "No such file" in str(err)


def test_pool_reuses_warm_sessions_and_replaces_dead_ones(sandbox_image):
    code = OK_ENV + "    def die(self):\n        import os; os._exit(3)\n"
    with SessionPool(code, size=2, limits=LIMITS) as pool:
        a = pool.acquire()
        assert a.call("ping", 1) == {"pong": 1}
        pool.release(a)
        b = pool.acquire()
        assert b is a  # warm reuse
        with pytest.raises(SandboxError) as info:
            b.call("die")
        assert info.value.kind == "crashed"
        pool.release(b)
        c, d = pool.acquire(), pool.acquire()
        assert c.call("ping", 2) == {"pong": 2} and d.call("ping", 3) == {"pong": 3}
