"""serve=vllm on a CPU: vLLM's command line (base, LoRA), the one-line error without vllm, adapters as LoRA
requests through the one client, the backend of each evaluation row, GRPO's push-and-generate against a
fake OpenAI-shaped server (tests/support/fake_openai.py). vLLM itself never runs here (it needs CUDA)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI

from trace_rl.models import vllm_server
from trace_rl.models.endpoints import Endpoints
from trace_rl.models.llm import LLM, LLMConfig, served
from trace_rl.models.vllm_server import VllmMissing, VllmServer, lora_name


def flags(cmd: list[str]) -> dict[str, str | None]:
    """vLLM's part of a command line as {--flag: value or None}."""
    args = cmd[cmd.index("vllm.entrypoints.openai.api_server") + 1:]
    out: dict = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            out[a] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
    return out


def test_the_base_server_runs_vllms_own_openai_server_for_the_hf_folder_without_lora(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    srv = VllmServer("/cache/hf/qwen2.5-coder-1.5b", served_name="qwen2.5-coder-1.5b", port=8123, max_num_seqs=128)
    cmd = srv.command()
    assert cmd[1:4] == ["-m", "trace_rl.models.vllm_server", "--parent"]  # the watcher, then vLLM as documented
    assert cmd[cmd.index("--") + 1:][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    f = flags(cmd)
    assert f["--model"] == "/cache/hf/qwen2.5-coder-1.5b" and f["--served-model-name"] == "qwen2.5-coder-1.5b"
    assert f["--port"] == "8123" and f["--max-num-seqs"] == "128" and f["--dtype"] == "bfloat16"
    assert f["--tool-call-parser"] == "hermes" and "--enable-auto-tool-choice" in f
    assert json.loads(f["--structured-outputs-config"]) == {"backend": "guidance"}  # the bundle's xgrammar is a stub
    assert not {"--enable-lora", "--max-loras", "--lora-modules"} & set(f)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in srv.env()
    assert srv.model_name == "qwen2.5-coder-1.5b"


def test_with_lora_the_server_takes_adapters_at_run_time_and_at_start_up():
    srv = VllmServer("/hf/m", served_name="m", enable_lora=True, max_loras=3)
    f = flags(srv.command())
    assert "--enable-lora" in f and f["--max-loras"] == "3" and f["--max-lora-rank"] == "16"
    assert int(f["--max-cpu-loras"]) >= 3
    assert srv.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # /v1/load_lora_adapter exists only then
    static = VllmServer("/hf/m", lora_modules={"lookup": "/runs/r/train/lookup/adapter"})
    cmd = static.command()
    assert "--enable-lora" in cmd and cmd[cmd.index("--lora-modules") + 1] == "lookup=/runs/r/train/lookup/adapter"


def test_without_vllm_serve_vllm_is_one_line_that_says_how_to_get_it(monkeypatch):
    from typer.testing import CliRunner

    from trace_rl.graph.cli import app

    monkeypatch.setattr(vllm_server, "vllm_available", lambda: False)
    with pytest.raises(VllmMissing, match=r"vllm is not importable .*pip install 'trace-rl\[vllm\]'.*gpu_vllm.sh"):
        served(LLMConfig(model="qwen2.5-coder-1.5b"), "vllm")
    for args in (["eval", "--serve", "vllm", "--benchmark", "no-such:bench"], ["serve", "m", "--serve", "vllm"],
                 ["run", "--serve", "vllm", "--show-config"]):
        res = CliRunner().invoke(app, args)
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert res.exit_code == 2 and len(lines) == 1, (args, res.output)
        assert "vllm is not importable" in lines[0] and "trace-rl[vllm]" in lines[0]


class StartedElsewhere(VllmServer):
    """A VllmServer whose process is the fake server's: start() only takes its port."""
    fake_port = 0

    def start(self):
        self.port = self.fake_port
        return self

    def stop(self):
        pass


@pytest.fixture
def fake_vllm(monkeypatch):
    with FakeOpenAI(tokens=5, models=("qwen2.5-coder-1.5b",)) as fake:
        monkeypatch.setattr(vllm_server, "vllm_available", lambda: True)
        monkeypatch.setattr(StartedElsewhere, "fake_port", fake.port)
        monkeypatch.setattr(vllm_server, "VllmServer", StartedElsewhere)
        monkeypatch.setattr("trace_rl.models.llm.ENDPOINTS", Endpoints())
        monkeypatch.setattr("trace_rl.models.weights.hf_checkpoint", lambda name: Path(name))  # no conversion here
        yield fake


def test_each_adapter_alone_is_a_lora_request_naming_the_adapter(fake_vllm, tmp_path):
    adapter = tmp_path / "train" / "lookup" / "adapter"
    base = LLM(served(LLMConfig(model="qwen2.5-coder-1.5b"), "vllm", weights="/hf/m", lora_capable=True))
    row = LLM(served(LLMConfig(model="qwen2.5-coder-1.5b", lora=str(adapter), temperature=0.0), "vllm"))
    again = LLM(served(LLMConfig(model="qwen2.5-coder-1.5b", lora=str(adapter)), "vllm"))
    assert base.config.base_url == row.config.base_url == fake_vllm.base_url  # one server for the model
    assert row.config.lora is None and row.config.model == lora_name(adapter) == again.config.model
    assert lora_name(adapter).startswith("lookup-")
    assert fake_vllm.routes("load_lora_adapter") == [{"lora_name": lora_name(adapter), "lora_path": str(adapter)}]
    base.chat([{"role": "user", "content": "hi"}])
    row.chat([{"role": "user", "content": "hi"}])
    assert [b["model"] for b in fake_vllm.routes("completions")] == ["qwen2.5-coder-1.5b", lora_name(adapter)]
    assert base.backend == row.backend == "vllm"
    assert LLM(LLMConfig(model="qwen2.5-coder-0.5b")).backend == "llama.cpp"
    assert LLM(LLMConfig(model="gpt", base_url="http://example.invalid/v1")).backend == "endpoint"


def test_an_adapter_on_a_server_started_without_lora_is_refused_plainly(fake_vllm, tmp_path):
    served(LLMConfig(model="qwen2.5-coder-1.5b"), "vllm", weights="/hf/m")  # the first caller: no LoRA
    with pytest.raises(ValueError, match="without --enable-lora"):
        served(LLMConfig(model="qwen2.5-coder-1.5b", lora=str(tmp_path / "a")), "vllm")


def test_the_pipeline_under_vllm_serves_adapter_rows_from_the_base_models_lora_server(fake_vllm, tmp_path):
    from trace_rl.graph.config import load_config
    from trace_rl.graph.pipeline import default_components

    cfg = load_config(overrides={"serve": "vllm", "base_model": "qwen2.5-coder-1.5b", "train_model": "/hf/m",
                                 "benchmark": "toolsandbox"})
    comps = default_components(cfg)
    assert comps.lora_agent is not None  # each adapter alone and grpo_target: LoRA requests, not in-process
    analyst = comps.analyst  # the same 1.5B: the same server, started with LoRA whichever role came first
    analyst.chat([{"role": "user", "content": "hi"}])
    row = comps.lora_agent(str(tmp_path / "train" / "lookup" / "adapter"))
    assert row.backend == "vllm" and row.config.model.startswith("lookup-")
    from trace_rl.graph.pipeline import Pipeline  # GRPO's groups: the same server (LoRA on, the weights trained on)

    assert Pipeline(tmp_path / "run", cfg)._rollout_server() == fake_vllm.base_url
    plain = load_config(overrides={"serve": "hf", "benchmark": "toolsandbox"})
    assert default_components(plain).lora_agent is None  # the engine server serves no adapter: in-process rows


def test_serve_is_how_the_run_runs_not_a_result():
    from trace_rl.graph.config import load_config, stage_fingerprints

    base = stage_fingerprints(load_config(overrides={"benchmark": "toolsandbox"}))
    for over in ({"serve": "vllm"}, {"serve": "vllm", "vllm_gpu_memory": 0.6, "serve_rows": 256}, {"serve": "hf"}):
        assert stage_fingerprints(load_config(overrides={"benchmark": "toolsandbox", **over})) == base


def test_each_evaluation_row_records_its_backend(fake_vllm, tmp_path):
    from trace_rl.evals.evaluate import backend
    from trace_rl.graph.report import EVAL_COLUMNS, evaluation_rows

    class InProcess:  # the router, the moe, an adapter decoded in-process
        name = "router"

    row = LLM(served(LLMConfig(model="qwen2.5-coder-1.5b", lora=str(tmp_path / "x" / "adapter")), "vllm",
                     weights="/hf/m"))
    assert backend(row) == "vllm" and backend(InProcess()) == "engine"
    figs = {"tasks": 2, "trials": 1, "pass@1": 0.5, "ci95": [0.1, 0.9], "passed": 1, "episodes": 2, "mean_reward": 0.5}
    rows = evaluation_rows({"evaluation": {"x": {**figs, "backend": "vllm"}, "moe": {**figs, "backend": "engine"},
                                           "old": figs}})
    col = EVAL_COLUMNS.index("backend")
    assert [r[col] for r in rows] == ["vllm", "engine", "–"]


def test_grpo_pushes_the_adapter_each_step_and_generates_the_turn_there(fake_vllm, tmp_path):
    from trace_rl.training.grpo import VllmRollouts

    class Peft:  # what trl's unwrapped model is asked for: save_pretrained(folder)
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)
            (Path(path) / "adapter_config.json").write_text("{}")

    gen = VllmRollouts(fake_vllm.base_url, tmp_path / "vllm_adapter", "grpo-lookup-r0", [151645], 1.0)
    with pytest.raises(RuntimeError, match="before push"):
        gen.generate([[1, 2]], 4)
    assert gen.push(Peft(), 0) == "grpo-lookup-r0-s0"
    out = gen.generate([[1, 2, 3], [4, 5]], 4)
    assert out == [[7] * 4, [7] * 4]
    req = fake_vllm.routes("completions")[-1]
    assert req["model"] == "grpo-lookup-r0-s0" and req["prompt"] == [[1, 2, 3], [4, 5]]
    assert req["return_token_ids"] and req["stop_token_ids"] == [151645] and req["temperature"] == 1.0
    gen.push(Peft(), 1)  # the next step: a new name (vLLM's prefix cache is keyed by the adapter), the old one goes
    assert list(fake_vllm.loras) == ["grpo-lookup-r0-s1"]
    assert fake_vllm.routes("unload_lora_adapter") == [{"lora_name": "grpo-lookup-r0-s0"}]
    assert sorted(p.name for p in (tmp_path / "vllm_adapter").iterdir()) == ["step-1"]
    gen.generate([[1]], 2)
    assert fake_vllm.routes("completions")[-1]["model"] == "grpo-lookup-r0-s1"
