"""benchmarks/serving.py's CPU side (arguments, concurrent fan-out, the table) against a fake OpenAI-shaped
server (tests/support/fake_openai.py). The figures it exists for need a GPU: vLLM and the engine never run here."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI

ROOT = Path(__file__).resolve().parents[2]


def serving():
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments_are_checked():
    s = serving()
    a = s.parse_args([])
    assert a.batches == [1, 32, 256] and a.backends == ["vllm", "engine"] and a.episodes == 64
    with pytest.raises(SystemExit):
        s.parse_args(["--backends", "vllm,sglang"])
    with pytest.raises(SystemExit):
        s.parse_args(["--endpoint", "no-url"])


def test_batches_are_concurrent_requests_and_the_table_has_a_row_per_backend_and_adapter(tmp_path, capsys):
    s = serving()
    with FakeOpenAI(tokens=6, delay=1.0, models=("m", "lookup")) as a, FakeOpenAI(tokens=3, models=("m",)) as b:
        out = tmp_path / "serving.json"
        res = s.main(["--endpoint", f"fast={a.base_url}", "--endpoint", f"slow={b.base_url}", "--model", "m",
                      "--batches", "1,8", "--max-tokens", "6", "--rounds", "1", "--out", str(out)])
        assert a.max_in_flight == 8  # B=8: eight requests in flight at once, not one after another
        assert {r["model"] for r in a.routes("completions")} == {"m"}
        assert all(r["max_tokens"] == 6 and r["temperature"] == 0.0 for r in a.routes("completions"))
    fast = res["backends"]["fast"]["base"]
    assert [r["B"] for r in fast] == [1, 8] and fast[1]["tokens"] == 48 and fast[1]["mean_tokens"] == 6
    assert fast[1]["seconds"] < 1.0 * 8 / 2  # together, not in sequence (a 1 s delay leaves a loaded CI room)
    assert res["backends"]["slow"]["base"][0]["mean_tokens"] == 3
    table = capsys.readouterr().out
    assert "| backend | adapter | tok/s B=1 (tokens/req) | tok/s B=8 (tokens/req) | start-up s | episodes/min |" in table
    assert any(line.startswith("| fast | base |") and "(6)" in line for line in table.splitlines())
    assert json.loads(out.read_text())["table"] == res["table"]


def test_the_lora_row_names_the_adapter_and_a_failed_request_fails_the_row():
    s = serving()
    with FakeOpenAI(tokens=4, models=("m", "lookup")) as fake:
        res = s.main(["--endpoint", f"vllm={fake.base_url}", "--model", "m", "--lora-model", "lookup",
                      "--batches", "2", "--rounds", "1"])
        assert [r["model"] for r in fake.routes("completions")] == ["m", "m", "lookup", "lookup"]
        assert "| vllm | lora |" in res["table"]
        with pytest.raises(RuntimeError, match="2 of 2 requests failed"):
            s.main(["--endpoint", f"vllm={fake.base_url}", "--model", "unknown", "--batches", "2", "--rounds", "1"])
