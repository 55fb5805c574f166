import pytest

pytestmark = [pytest.mark.docker, pytest.mark.ci, pytest.mark.slow]


def test_container_runs_python_without_network(sandbox_image):
    from trace_rl.sandbox.session import SANDBOX_UID, EnvSession, self_check

    with EnvSession(image=sandbox_image) as s:
        out = s.exec(
            "import socket, os\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('CONNECTED')\n"
            "except OSError as e:\n    print('blocked', e.errno)\n"
            "print('uid', os.getuid())\n"
            "try:\n    open('/etc/evil', 'w'); print('WROTE')\nexcept OSError as e:\n    print('ro', e.errno)\n",
            timeout=30)
    assert "CONNECTED" not in out and "blocked" in out
    assert f"uid {SANDBOX_UID}" in out and "WROTE" not in out
    ok, text = self_check()  # what `trace-rl sandbox check` runs
    assert ok and "no network" in text, text


def test_no_setuid_binaries_and_the_uid_is_no_host_account(sandbox_image):
    import pwd

    from trace_rl.sandbox.session import SANDBOX_UID, EnvSession

    with EnvSession(image=sandbox_image) as s:
        out = s.exec("import os, stat\n"
                     "bad = [os.path.join(d, f) for d, _, fs in os.walk('/usr') for f in fs\n"
                     "       if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f))\n"
                     "       and os.stat(os.path.join(d, f)).st_mode & (stat.S_ISUID | stat.S_ISGID)]\n"
                     "print('SETUID', len(bad), bad[:5])\nprint('ids', os.getuid(), os.getgid())\n", timeout=60)
    assert "SETUID 0 []" in out, out
    assert f"ids {SANDBOX_UID} {SANDBOX_UID}" in out
    with pytest.raises(KeyError):
        pwd.getpwuid(SANDBOX_UID)


def test_image_tag_is_recipe_hash():
    from trace_rl.sandbox.engine import SANDBOX_REPO, sandbox_tag

    tag = sandbox_tag()
    assert tag.startswith(SANDBOX_REPO + ":") and tag == sandbox_tag()
