import pytest

pytestmark = [pytest.mark.docker, pytest.mark.ci, pytest.mark.slow]


def test_container_runs_python_without_network(sandbox_image):
    from trace_rl.sandbox.run import run_python

    res = run_python(
        "import socket, os\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('CONNECTED')\n"
        "except OSError as e:\n    print('blocked', e.errno)\n"
        "print('uid', os.getuid())\n"
        "try:\n    open('/etc/evil', 'w'); print('WROTE')\nexcept OSError as e:\n    print('ro', e.errno)\n")
    assert res.exit_code == 0, res.stderr
    assert "CONNECTED" not in res.stdout and "blocked" in res.stdout
    assert "uid 1000" in res.stdout and "WROTE" not in res.stdout


def test_image_tag_is_recipe_hash():
    from trace_rl.sandbox.engine import SANDBOX_REPO, sandbox_tag

    tag = sandbox_tag()
    assert tag.startswith(SANDBOX_REPO + ":") and tag == sandbox_tag()
