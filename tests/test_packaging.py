import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["agents", "graph", "sandbox", "training", "prompts", "evals"]


def test_editable_install_imports_every_subpackage():
    import importlib

    for name in SUBPACKAGES:
        mod = importlib.import_module(f"trace_rl.{name}")
        assert Path(mod.__file__).resolve().parent == ROOT / name
    from trace_rl import prompts

    assert "base_agent" in prompts.names() and "{policy}" in prompts.load("base_agent")


@pytest.mark.ci
@pytest.mark.slow
def test_wheel_installs_into_fresh_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("trace_rl-*.whl"))
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    code = ("import importlib; [importlib.import_module('trace_rl.' + n) for n in %r];"
            "from trace_rl import prompts; assert 'base_agent' in prompts.names();"
            "from importlib import resources; import trace_rl.sandbox as s;"
            "assert (resources.files(s) / 'image' / 'Dockerfile').is_file(); print('ok')" % SUBPACKAGES)
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "ok", out.stderr
