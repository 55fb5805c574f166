"""Long prompts' llama.cpp states kept on disk between servers: restored, they give the same outputs."""
import pytest
from trace_rl.models.llm import LLM
from trace_rl.models.llama_server import LlamaServer

POLICY = "You are a careful support agent. " + " ".join(f"Rule {i}: check the record of item {i} first." for i in range(60))


def ask(srv: LlamaServer, question: str) -> str:
    llm = LLM(model=srv.model_name, base_url=srv.base_url, api_key="x", max_tokens=24, temperature=0.0)
    return llm.chat([{"role": "system", "content": POLICY}, {"role": "user", "content": question}]).content


def server(states, **kw) -> LlamaServer:
    return LlamaServer("smollm2-135m", n_ctx=2048, prompt_states=states, prompt_state_min_tokens=200, **kw)


def test_long_prompt_states_outlast_newer_short_ones():
    """A pipeline saves states of unique analysis prompts between its rollout and its evaluation: half
    the slots keep the newest, the other half the longest of the rest (τ²'s 10k-token prompts)."""
    from pathlib import Path

    from trace_rl.models.llama_server import states_to_keep

    newest_first = [(Path("labels-3"), [0] * 3000), (Path("labels-2"), [0] * 3500), (Path("ticket-b"), [0] * 9919),
                    (Path("labels-1"), [0] * 2500), (Path("ticket-a"), [0] * 9900)]
    assert states_to_keep(newest_first, 4) == [Path(p) for p in ("labels-3", "labels-2", "ticket-b", "ticket-a")]
    assert states_to_keep(newest_first, 3) == [Path(p) for p in ("labels-3", "ticket-b", "ticket-a")]
    assert states_to_keep(newest_first, 9) == [p for p, _ in newest_first]


@pytest.mark.slow
@pytest.mark.ci
def test_a_restored_prompt_state_gives_the_same_replies_and_a_torn_one_is_recomputed(tmp_path):
    questions = ["What do you check first for item 3?", "Which rule is about item 41?"]
    with server(None) as plain:
        expected = [ask(plain, q) for q in questions]

    states = tmp_path / "states"
    with server(states) as first:  # nothing saved yet: computes the prompt and saves its state
        assert ask(first, questions[0]) == expected[0]
    saved = list(states.rglob("*.state"))
    assert len(saved) == 1 and saved[0].with_name(saved[0].stem + ".tokens.json").is_file()

    with server(states) as second:  # a new server: restores the saved prefix, for the same and for another question
        assert [ask(second, q) for q in questions] == expected
    log = (second.log_path).read_text()
    assert log.count("trace-rl prompt state: restored") >= 1, log[-2000:]

    saved[0].write_bytes(saved[0].read_bytes()[:1000])  # torn: must be recomputed, never trusted
    with server(states) as third:
        assert ask(third, questions[1]) == expected[1]
    assert "restored" not in third.log_path.read_text()


@pytest.mark.slow
@pytest.mark.ci
def test_servers_keep_prompt_states_in_the_cache_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("TRACE_RL_PROMPT_STATES", raising=False)
    assert LlamaServer("smollm2-135m").prompt_states == tmp_path / "prompt-states"
    monkeypatch.setenv("TRACE_RL_PROMPT_STATES", str(tmp_path / "elsewhere"))
    assert LlamaServer("smollm2-135m").prompt_states == tmp_path / "elsewhere"
    monkeypatch.setenv("TRACE_RL_PROMPT_STATES", "0")
    assert LlamaServer("smollm2-135m").prompt_states is None
    monkeypatch.undo()
    assert f"--prompt-states={tmp_path}" in LlamaServer("smollm2-135m", prompt_states=tmp_path).command()
    assert not any(a.startswith("--prompt-state") for a in LlamaServer("smollm2-135m", prompt_states=None).command())


def test_the_prompt_state_cache_drops_least_recently_used_folders_over_its_budget(tmp_path):
    """Every evaluated adapter makes a folder of states; past the budget the oldest folders go, never the one
    in use, and nothing goes while the cache fits."""
    import os

    from trace_rl.models.llama_server import prune_prompt_states

    folders = {}
    for age, name in enumerate(["adapter-c", "adapter-b", "adapter-a", "current"]):  # c oldest
        d = tmp_path / name
        d.mkdir()
        (d / "x.state").write_bytes(b"\0" * 400_000)
        os.utime(d / "x.state", (1_000_000 + age, 1_000_000 + age))
        folders[name] = d
    os.utime(folders["current"] / "x.state", (1, 1))  # in use, though its file is the oldest
    gb = 1 / 2**30
    assert prune_prompt_states(tmp_path, folders["current"], budget_gb=2_000_000 * gb) == []  # 1.6 MB fits
    assert prune_prompt_states(tmp_path, folders["current"], budget_gb=900_000 * gb) == [
        folders["adapter-c"], folders["adapter-b"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-a", "current"]
    assert prune_prompt_states(tmp_path, folders["current"], budget_gb=0) == [folders["adapter-a"]]
    assert [p.name for p in tmp_path.iterdir()] == ["current"]


def test_flash_attention_is_opt_in_and_keeps_its_own_prompt_states(tmp_path):
    """Off by default: under it a reply depends on how the prompt was split between cached and new tokens
    (so it is a run config setting, in every stage's fingerprint)."""
    from trace_rl.graph.config import RunConfig, stage_fingerprints
    from trace_rl.models.llama_server import PromptStates
    from trace_rl.models.weights import gguf_path

    cmd = server(None).command()
    assert cmd[cmd.index("--flash_attn") + 1] == "false"
    cmd = server(None, flash_attn=True).command()
    assert cmd[cmd.index("--flash_attn") + 1] == "true"
    plain, flash = stage_fingerprints(RunConfig()), stage_fingerprints(RunConfig(flash_attn=True))
    assert all(plain[stage] != flash[stage] for stage in plain)
    model = gguf_path("smollm2-135m")
    dirs = {PromptStates(tmp_path, model, 2048, 512, flash_attn=fa).dir for fa in (False, True)}
    assert len(dirs) == 2  # the two kernels' caches are not interchangeable
