"""GRPO on tiny random models: token bookkeeping, LoRA-only updates, exact resume, redraws."""
import json
import shutil

import pytest
import torch

from tiny import LetterBench, tiny_model, tiny_tokenizer
from trace_rl.training.grpo import PRESETS, CapabilityGRPO, TokenRollout, hinted_slots
from trace_rl.models.hf_policy import encode
from paths import ROOT, SUPPORT

CALL = '<tool_call>\n{"name": "get_user", "arguments": {"user_id": "u1"}}\n</tool_call>'


def scripted_generate(tok, texts):
    """A generator that writes `texts` in order, one per turn, for every sequence."""
    turn = {"n": 0}

    def gen(seqs, max_new):
        text = texts[min(turn["n"], len(texts) - 1)]
        turn["n"] += 1
        return [(encode(tok, text) + [tok.eos_token_id])[:max_new] for _ in seqs]
    return gen


def test_token_rollout_masks_environment_tokens_and_swaps_the_hint_back():
    tok = tiny_tokenizer()
    bench = LetterBench()
    eps = TokenRollout(bench, tok, PRESETS["tiny"].model_copy(update={"max_steps": 4, "max_turn_tokens": 64})).run(
        scripted_generate(tok, [CALL, "aaaa"]), ["3", "3"], [True, False])
    hinted, plain = eps
    for e in eps:
        model_tokens = [t for t, m in zip(e.completion_ids, e.env_mask) if m]
        env_tokens = [t for t, m in zip(e.completion_ids, e.env_mask) if not m]
        assert tok.decode(model_tokens) == CALL + "<|im_end|>" + "aaaa<|im_end|>"
        assert '{"city": "Paris"}' in tok.decode(env_tokens) and "Paris" not in tok.decode(model_tokens)
        assert e.reward == 1.0 and e.success and e.turns == 2 and e.termination == "agent_stop"
        assert e.messages[2]["tool_calls"][0]["function"]["name"] == "get_user"
    assert "Hint:" in tok.decode(hinted.gen_prompt_ids) and "Hint:" not in tok.decode(hinted.prompt_ids)
    assert hinted.prompt_ids == plain.prompt_ids == plain.gen_prompt_ids
    assert all(ep.closed for ep in bench.opened)


def test_token_rollout_ends_on_turn_and_length_limits():
    tok = tiny_tokenizer()
    s = PRESETS["tiny"].model_copy(update={"max_steps": 2, "max_turn_tokens": 64})
    [e] = TokenRollout(LetterBench(), tok, s).run(scripted_generate(tok, [CALL]), ["1"], [False])
    assert e.termination == "max_steps" and e.turns == 2
    s = PRESETS["tiny"].model_copy(update={"max_steps": 9, "max_seq_len": 600, "max_turn_tokens": 64})
    [e] = TokenRollout(LetterBench(), tok, s).run(scripted_generate(tok, [CALL]), ["1"], [False])
    assert e.termination == "context_length" and len(e.gen_prompt_ids) + len(e.completion_ids) <= 600


def test_hinted_slots():
    assert hinted_slots(16, 0.25) == [True] * 4 + [False] * 12
    assert hinted_slots(4, 0.0) == [False] * 4


def _train(out, steps=2, seed=0):
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    bench = LetterBench()
    g = CapabilityGRPO(model, tok, bench, [t.id for t in bench.tasks()], out,
                       PRESETS["tiny"].model_copy(update={"steps": steps}), name="letters")
    return g, g.train(), base


def test_grpo_changes_only_lora_weights(tmp_path):
    g, res, base = _train(tmp_path)
    peft_model = g.trainer.model
    changed_lora, changed_base = 0, []
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            changed_lora += "lora_B" in name and bool(p.abs().sum() > 0)  # B starts at 0
        else:
            orig = name.replace("base_model.model.", "").replace(".base_layer", "")
            if not torch.equal(p.detach(), base[orig]):
                changed_base.append(name)
    assert changed_lora > 0 and changed_base == []
    assert res.steps == 2 and len(res.log) == 2 and all("kl_to_base" in r for r in res.log)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and (tmp_path / "curve.png").is_file()
    assert any((tmp_path / "tensorboard").iterdir())
    rows = [json.loads(l) for l in (tmp_path / "rollouts" / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 and {r["split"] for r in rows} == {"train"}


def test_resume_from_a_checkpoint_gives_the_same_next_step(tmp_path):
    _, full, _ = _train(tmp_path / "full")
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint-1", resumed_dir / "checkpoints" / "checkpoint-1")
    # a kill while step 2 was being saved: its folder exists, its trainer_state.json does not
    torn = resumed_dir / "checkpoints" / "checkpoint-2"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint-2", torn)
    (torn / "trainer_state.json").unlink()
    (torn / "adapter_model.safetensors").unlink()
    _, resumed, _ = _train(resumed_dir)
    assert [r["step"] for r in resumed.log] == [1, 2]  # step 1 comes back from the checkpoint's state
    kept = list((resumed_dir / "checkpoints" / "incomplete").iterdir())  # set aside, not deleted
    assert len(kept) == 1 and kept[0].name.startswith("checkpoint-2-") and (kept[0] / "adapter_config.json").is_file()
    keys = ["reward", "reward_std", "loss", "grad_norm", "kl_to_base"]
    assert {k: resumed.log[1][k] for k in keys} == {k: full.log[1][k] for k in keys}
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "full", resumed_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_killed_after_its_last_checkpoint_trains_no_extra_step(tmp_path):
    _, full, _ = _train(tmp_path / "full")
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint-2", tmp_path / "resumed" / "checkpoints" / "checkpoint-2")
    _, resumed, _ = _train(tmp_path / "resumed")
    assert resumed.steps == 2 and [r["step"] for r in resumed.log] == [1, 2]
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "full", tmp_path / "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class HalfDeadBench(LetterBench):
    """Even task ids give reward 0 whatever the agent writes: their groups carry no signal."""

    def episode(self, task_id, hinted=False):
        ep = super().episode(task_id, hinted)
        if int(task_id) % 2 == 0:
            ep.score = lambda termination: __import__("trace_rl.evals.benchmark", fromlist=["Score"]).Score(0.0, False)
        return ep


class AlternatingBench(LetterBench):
    """Every other episode scores 1 whatever the agent writes: every group carries a signal."""

    def __init__(self):
        super().__init__()
        self.started = __import__("itertools").count()

    def episode(self, task_id, hinted=False):
        from trace_rl.evals.benchmark import Score

        ep = super().episode(task_id, hinted)
        won = next(self.started) % 2 == 1
        ep.score = lambda termination: Score(float(won), won)
        return ep


def test_a_step_with_a_non_finite_gradient_is_skipped(tmp_path):
    """One NaN gradient, clipped, makes every gradient NaN, and Adam would write NaN into every LoRA
    weight: such a step is skipped and logged, and the adapter stays finite (here: untouched)."""
    from trace_rl.training.grpo import adapter_changed

    tok = tiny_tokenizer()
    g = CapabilityGRPO(tiny_model(tok), tok, AlternatingBench(), ["1", "3"], tmp_path,
                       PRESETS["tiny"].model_copy(update={"steps": 2}))
    trainer = g.build()
    first_a = next(p for n, p in trainer.model.named_parameters() if "lora_A" in n)
    first_a.register_hook(lambda grad: grad * float("nan"))
    res = g.train()
    assert [r["skipped_no_signal"] for r in res.log] == [0.0, 0.0]  # the loss had a signal to follow
    assert [r["skipped_nonfinite_grad"] for r in res.log] == [1.0, 1.0]
    assert all(bool(torch.isfinite(p).all()) for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert not adapter_changed(res.adapter)


def test_constant_groups_are_redrawn(tmp_path):
    tok = tiny_tokenizer()
    bench = HalfDeadBench()
    g = CapabilityGRPO(tiny_model(tok), tok, bench, ["0", "2", "4", "5"], tmp_path,
                       PRESETS["tiny"].model_copy(update={"steps": 3, "resample_constant_groups": 3}))
    res = g.train()
    assert sum(r["episode/redrawn_groups"] for r in res.log) > 0
    # a step is left without signal only when its group stayed constant after the last redraw
    assert all(r["reward_std"] > 0 or r["episode/constant_groups"] == 1 for r in res.log)


def test_data_parallel_training_matches_one_process(tmp_path):
    """Two processes (torchrun, gloo) sharing one global batch train the same adapter as one."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    here = str(SUPPORT)
    env = {**os.environ, "PYTHONPATH": here, "OMP_NUM_THREADS": "1"}
    worker = os.path.join(here, "grpo_dp_worker.py")
    subprocess.run([sys.executable, worker, str(tmp_path / "one")], env=env, check=True, timeout=600)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker,
                    str(tmp_path / "two")], env=env, check=True, timeout=600)
    one, two = (load_file(str(tmp_path / d / "adapter" / "adapter_model.safetensors")) for d in ("one", "two"))
    assert one.keys() == two.keys() and any(v.abs().sum() > 0 for k, v in one.items() if "lora_B" in k)
    assert all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)
    logs = [json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("one", "two")]
    assert [round(r["reward"], 6) for r in logs[0]] == [round(r["reward"], 6) for r in logs[1]]
    assert (tmp_path / "two" / "rollouts" / "rank1" / "trajectories.jsonl").is_file()


def test_groups_per_step_must_split_evenly_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    tok = tiny_tokenizer()
    g = CapabilityGRPO(tiny_model(tok), tok, LetterBench(), ["1"], tmp_path,
                       PRESETS["tiny"].model_copy(update={"groups_per_step": 3}))
    with pytest.raises(ValueError, match="groups_per_step=3 must be a multiple of the 2"):
        g.config()


@pytest.mark.docker
def test_train_command_under_torchrun(tmp_path):
    """The documented multi-GPU launch, on 2 CPU processes: every rank trains on a sandboxed
    library env, rank 0 alone runs the held-out episodes and writes the report."""
    import os
    import subprocess
    import sys

    from tiny import save_tiny

    ckpt = save_tiny(tmp_path / "tiny")
    env_py = ROOT / "sandbox" / "envs" / "tool_call_precision_telecom.py"
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "trace_rl.graph.cli",
                    "train", str(env_py), "--model", str(ckpt), "--preset", "tiny", "--set", "groups_per_step=2",
                    "--set", "steps=2", "--heldout", "2", "--train-seeds", "20", "--out", str(out)],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=600)
    d = out / "train" / env_py.stem
    report = json.loads((d / "report.json").read_text())
    assert report["steps"] == 2 and set(report["before"]) >= {"success", "mean_reward"} and "after" in report
    assert (d / "grpo" / "adapter" / "adapter_model.safetensors").is_file()
    assert {p.name for p in (d / "grpo" / "rollouts").iterdir()} >= {"rank0", "rank1"}


def test_kl_is_logged_every_n_steps(tmp_path):
    tok = tiny_tokenizer()
    bench = LetterBench()
    res = CapabilityGRPO(tiny_model(tok), tok, bench, [t.id for t in bench.tasks()], tmp_path,
                         PRESETS["tiny"].model_copy(update={"steps": 3, "kl_every": 2})).train()
    assert [("kl_to_base" in r) for r in res.log] == [True, False, True]
    assert (tmp_path / "curve.png").is_file()


def test_a_batch_without_signal_changes_nothing(tmp_path):
    """Every group constant (reward 0 on even tasks, no redraws): no forward/backward, no update."""
    tok = tiny_tokenizer()
    g = CapabilityGRPO(tiny_model(tok), tok, HalfDeadBench(), ["0", "2"], tmp_path,
                       PRESETS["tiny"].model_copy(update={"steps": 2, "resample_constant_groups": 0}))
    res = g.train()
    assert [r["skipped_no_signal"] for r in res.log] == [1.0, 1.0]
    lora_b = [p for n, p in g.trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().sum()) == 0.0 for p in lora_b)


def test_grpo_on_the_target_benchmark_trains_an_adapter_and_resumes_from_disk(tmp_path):
    """The baseline's train stage: GRPO on a benchmark's own tasks (here the letters toy)."""
    from trace_rl.training.train import train_on_target

    tok = tiny_tokenizer()
    bench = LetterBench()
    loads = []
    load = lambda: loads.append(1) or (tiny_model(tok), tok)
    rec = train_on_target(bench, [t.id for t in bench.tasks()], tmp_path / "target", load, PRESETS["tiny"], log=print)
    assert rec.trained_on.name == "target" and rec.steps == 2 and (tmp_path / "target" / "adapter").is_dir()
    assert json.loads((tmp_path / "target" / "report.json").read_text())["capability"] == "grpo_target"
    again = train_on_target(bench, [t.id for t in bench.tasks()], tmp_path / "target", load, PRESETS["tiny"], log=print)
    assert again == rec and len(loads) == 1  # the finished adapter is read back, nothing retrained
