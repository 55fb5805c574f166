"""GRPO on one capability's environment: one LoRA adapter on a frozen base (TRACE §4).

trl's GRPOTrainer does the optimisation (clipped objective, DAPO ε-high, no KL term by
default, checkpoints, TensorBoard); our `rollout_func` plays whole multi-turn tool episodes:

- the episodes of a step run in lockstep, one batched turn at a time in the static-cache engine
  (models/engine.py: caches kept between turns, the group's prompt computed once, the decode
  step one CUDA graph on a GPU), or trl's vLLM generation (`use_vllm`: colocated, trl merges the
  adapter into vLLM's weights), or a vLLM server (`rollout_url`, serve=vllm: the adapter alone is
  pushed to it before each step's rollouts, `VllmRollouts`);
- the model's own tokens are kept exactly as sampled; tool results and the next turn's
  header are rendered by the chat template and masked from the loss (`env_mask`);
- a `hint_fraction` of each group sees the environment's hint appended to its system
  prompt, and the plain prompt's tokens are what the loss sees (the hint is swapped back);
- a group whose rewards are all equal carries no signal: it is redrawn on another task up
  to `resample_constant_groups` times, and kept (zero advantage, no gradient) after that.

Any `Benchmark` whose episodes take `hinted=` trains this way: a synthesized environment
(sandboxed), or the target benchmark itself (the paper's "GRPO on the target" baseline).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from trace_rl.core.episode import Guarded, opening
from trace_rl.core.io import atomic_write_json
from trace_rl.core.rundir import GRPODir
from trace_rl.core.trajectory import Trajectory, TrajectoryStore
from trace_rl.evals.benchmark import hinted_episode
from trace_rl.models.chat import Reply, parse_tool_calls
from trace_rl.models.engine import Engine, Request, stop_ids
from trace_rl.models.hf_policy import encode, env_turn_ids, render


class GRPOSettings(BaseModel):
    """Defaults are the method's (TRACE §4); `PRESETS` holds sizes for small machines."""
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    group_size: int = Field(16, ge=2, description="episodes per task instance (G)")
    groups_per_step: int = Field(1, ge=1, description="task instances per optimizer step")
    learning_rate: float = Field(1e-5, gt=0)
    epsilon: float = Field(0.2, gt=0, le=1, description="lower clip")
    epsilon_high: float = Field(0.28, gt=0, le=1, description="upper clip (DAPO)")
    beta: float = Field(0.0, ge=0, description="KL coefficient; 0 = no KL term, no reference model")
    temperature: float = Field(1.0, gt=0, le=5)
    steps: int = Field(20, ge=1, description="optimizer steps (iterations)")
    hint_fraction: float = Field(0.25, ge=0, le=1, description="share of each group rolled out with the hint")
    max_steps: int | None = Field(None, ge=1, validation_alias=AliasChoices("max_steps", "max_turns"),
                                  description="agent steps per episode (one name with agent.max_steps and eval's "
                                              "--max-steps); unset: the episode's own limit")
    max_turn_tokens: int = Field(256, ge=8, description="tokens the model may write per turn")
    max_seq_len: int = Field(4096, ge=256, description="prompt + whole episode, in tokens")
    resample_constant_groups: int = Field(2, ge=0, le=20)
    save_steps: int = Field(5, ge=1, description="checkpoint every N steps (exact resume)")
    log_kl: bool = Field(True, description="log KL(policy || base) on sampled tokens (2 extra forwards)")
    kl_every: int = Field(1, ge=1, description="log the KL every N steps (it costs ~1/3 of a CPU step)")
    use_vllm: bool = Field(False, description="generate with trl's vLLM integration (GPU, `pip install trace-rl[gpu]`)")
    seed: int = 0


PRESETS: dict[str, GRPOSettings] = {
    "paper": GRPOSettings(),
    # 2-core CPU: a few dozen short steps. A larger step size stands in for the paper's
    # 1,280 rollouts; the group is small, so more groups per step keep the signal steady.
    "cpu": GRPOSettings(group_size=4, groups_per_step=2, learning_rate=2e-4, steps=30, max_steps=4,
                        max_turn_tokens=96, max_seq_len=2048, save_steps=5, hint_fraction=0.25),
    "tiny": GRPOSettings(group_size=2, groups_per_step=1, learning_rate=1e-3, steps=2, max_steps=2,
                         max_turn_tokens=8, max_seq_len=1024, save_steps=1, log_kl=True),
}


@dataclass
class TokenEpisode:
    """One episode as tokens: what the loss sees (`prompt_ids` + `completion_ids`, `env_mask`)."""
    task_id: str
    hinted: bool
    prompt_ids: list[int]  # the plain prompt (no hint)
    gen_prompt_ids: list[int]  # what the model was conditioned on (hint included when hinted)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model, 0 = environment / template
    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    termination: str = ""
    turns: int = 0


Generate = Callable[[list[list[int]], int], list[list[int]]]


class TokenRollout:
    """Plays episodes of a benchmark in lockstep and records them as tokens."""

    def __init__(self, bench, tokenizer, settings: GRPOSettings):
        self.bench, self.tok, self.s = bench, tokenizer, settings
        self.stops = stop_ids(tokenizer)

    def _start(self, task_id: str, hinted: bool):
        ep = Guarded(lambda: hinted_episode(self.bench, task_id, hinted))  # a plugin's hang, SystemExit: an error
        obs = ep.reset()
        plain = ep.plain_system_prompt or ep.system_prompt
        ids = lambda system: encode(self.tok, render(self.tok, opening(system, obs.messages), ep.tools,
                                                     add_generation_prompt=True))
        te = TokenEpisode(task_id, hinted, ids(plain), ids(ep.system_prompt), messages=opening(plain, obs.messages))
        if obs.done:
            te.termination = obs.reason or "env_done"
        return te, ep

    def _turn(self, te: TokenEpisode, ep, new: list[int]) -> bool:
        """Apply one sampled turn; True while the episode goes on."""
        te.turns += 1
        te.completion_ids += new
        te.env_mask += [1] * len(new)
        if not new or new[-1] not in self.stops:  # cut at the turn limit: close the turn (not trained on)
            te.completion_ids.append(self.stops[0])
            te.env_mask.append(0)
        text = self.tok.decode(new, skip_special_tokens=True).strip()
        calls = parse_tool_calls(text, {t["function"]["name"] for t in ep.tools}, loose=ep.text_tool_calls)
        msg = Reply(content="" if calls else text, tool_calls=calls).to_message()
        te.messages.append(msg)
        obs = ep.step(msg.get("content") or "", msg.get("tool_calls") or [])
        if obs.done:
            te.messages += obs.messages
            te.termination = obs.reason or "agent_stop"
            return False
        delta = env_turn_ids(self.tok, te.messages, obs.messages, ep.tools)
        te.messages += obs.messages
        if te.turns >= (self.s.max_steps or ep.max_steps):  # the user's limit, else the episode's own
            te.termination = "max_steps"
        elif len(te.gen_prompt_ids) + len(te.completion_ids) + len(delta) + self.s.max_turn_tokens > self.s.max_seq_len:
            te.termination = "context_length"
        else:
            te.completion_ids += delta
            te.env_mask += [0] * len(delta)
            return True
        return False

    def run(self, generate: Generate, task_ids: list[str], hinted: list[bool]) -> list[TokenEpisode]:
        # environments step in threads (a user simulator behind a batching server answers them
        # together); every thread finishes before an error goes up, and every started episode closes
        with ThreadPoolExecutor(max_workers=max(1, len(task_ids))) as pool:
            starts = [pool.submit(self._start, t, h) for t, h in zip(task_ids, hinted)]
            wait(starts)
            pairs = [f.result() for f in starts if f.exception() is None]
            try:
                for f in starts:
                    f.result()  # an episode that did not start: its error, once the others are closed
                live = [(te, ep) for te, ep in pairs if not te.termination]
                while live:
                    outs = generate([te.gen_prompt_ids + te.completion_ids for te, _ in live], self.s.max_turn_tokens)
                    turns = [pool.submit(self._turn, te, ep, new) for (te, ep), new in zip(live, outs)]
                    wait(turns)
                    live = [pair for pair, f in zip(live, turns) if f.result()]
                for te, ep in pairs:
                    score = ep.score(te.termination)
                    te.reward, te.success = float(score.reward), bool(score.passed)
            finally:
                for _, ep in pairs:
                    ep.close()
        return [te for te, _ in pairs]


class VllmRollouts:
    """GRPO's generation on a vLLM server of the same base weights (serve=vllm), the paper's recipe: before each
    step's rollouts the adapter as trained so far is saved (a few MB at r=16) and loaded by the server under a new
    name (`/v1/load_lora_adapter`; the previous step's is unloaded). A new name per step, not `load_inplace`: vLLM's
    prefix cache is keyed by the adapter's id, so cached blocks of the old weights would be reused in place.
    Each turn of the live episodes is one `/v1/completions` request with their token ids (they decode together,
    continuous batching); the tokens come back as sampled. Only the adapter moves: the base weights are not merged.
    Sampling is vLLM's (bf16, its kernels): the loss recomputes the old log-probs with the training model, as with
    the engine (rollout_func returns no logprobs)."""

    def __init__(self, base_url: str, folder: Path, name: str, stops: list[int], temperature: float):
        self.base_url, self.folder, self.name, self.stops, self.temperature = base_url, Path(folder), name, stops, temperature
        self.current: str | None = None

    def push(self, model, step: int) -> str:
        """Save `model`'s adapter (a peft model) and load it into the server; its served name."""
        from trace_rl.models.vllm_server import load_lora, unload_lora

        path = self.folder / f"step-{step}"
        if path.exists():
            shutil.rmtree(path)
        model.save_pretrained(str(path))
        name = f"{self.name}-s{step}"
        load_lora(self.base_url, name, path)
        if self.current and self.current != name:
            unload_lora(self.base_url, self.current)
            shutil.rmtree(self.folder / f"step-{self.current.rsplit('-s', 1)[1]}", ignore_errors=True)
        self.current = name
        return name

    def generate(self, seqs: list[list[int]], n: int) -> list[list[int]]:
        from trace_rl.models.vllm_server import complete_ids

        if self.current is None:
            raise RuntimeError("VllmRollouts.generate before push: no adapter on the server yet")
        return complete_ids(self.base_url, self.current, seqs, n, self.temperature, self.stops)


def hinted_slots(group_size: int, fraction: float) -> list[bool]:
    """Which members of a group see the hint: the first round(G * fraction)."""
    k = round(group_size * fraction)
    return [i < k for i in range(group_size)]


def redraw(task_ids: list[str], *key) -> str:
    """A task for a resampled group: deterministic in (step, group, attempt), so resume replays it."""
    h = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return task_ids[int.from_bytes(h[:8], "big") % len(task_ids)]


def token_logps(model, ids: list[int], start: int):
    """Log-probabilities of ids[start:] under `model` (no grad)."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, start - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, x[0, start:, None]).squeeze(-1)


def kl_to_base(model, eps: list[TokenEpisode]) -> float:
    """Mean k3 estimate of KL(policy || base) over the model's sampled tokens (LoRA disabled = base)."""
    total, n = 0.0, 0
    for te in eps:
        ids, start = te.prompt_ids + te.completion_ids, len(te.prompt_ids)
        mask = torch.tensor(te.env_mask, dtype=torch.bool)
        pol = token_logps(model, ids, start).cpu()
        with model.disable_adapter():
            ref = token_logps(model, ids, start).cpu()
        d = (ref - pol)[mask]
        total += float((d.exp() - d - 1).sum())
        n += int(mask.sum())
    return total / n if n else 0.0


def _signal_only_trainer():
    """trl's GRPOTrainer with two guards of the optimizer step.

    - A batch in which every group scored the same (all advantages 0, no KL term) skips the
      forward/backward: its gradient is exactly zero, and a step on it would only replay Adam's
      momentum. Weak base models produce such batches often, and the loss is most of a step's time.
    - A step whose gradient is not finite is skipped (`skipped_nonfinite_grad`): clipping a NaN norm
      turns every gradient into NaN and one Adam step then writes NaN into every LoRA weight, after
      which the policy only emits garbage.
    All processes decide together."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class SkipNonFiniteStep(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            acc = self.trainer.accelerator
            bad = any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            bad = float(acc.reduce(torch.tensor(float(bad), device=acc.device), "sum")) > 0
            self.trainer._metrics["train"]["skipped_nonfinite_grad"].append(float(bad))
            if bad:  # torch's optimizers leave a parameter without a gradient untouched
                for p in model.parameters():
                    p.grad = None

    class SignalOnlyGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(SkipNonFiniteStep(self))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.beta == 0.0:
                adv = inputs["advantages"]
                signal = float(self.accelerator.reduce(adv.abs().sum(), "sum"))
                self._metrics["train"]["skipped_no_signal"].append(float(signal == 0.0))
                if signal == 0.0:
                    return torch.zeros((), device=adv.device, requires_grad=True)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return SignalOnlyGRPOTrainer


@dataclass
class TrainResult:
    adapter: str
    steps: int
    log: list[dict]
    curve: str


class CapabilityGRPO:
    """GRPO for one capability: trl's GRPOTrainer + our multi-turn rollout, one LoRA adapter.

    `bench.episode(task_id, hinted=...)` must give an Episode; `task_ids` are the training
    instances (seeds, for a synthesized environment). Everything lands in `out_dir`:
    checkpoints/ (exact resume), tensorboard/, rollouts/ (every training episode, JSONL),
    adapter/ (the result), curve.png."""

    def __init__(self, model, tokenizer, bench, task_ids: list[str], out_dir: str | Path,
                 settings: GRPOSettings = GRPOSettings(), name: str = "adapter", decode: str = "auto",
                 rollout_url: str | None = None):
        if not task_ids:
            raise ValueError("GRPO needs at least one training task id")
        self.model, self.tok, self.bench, self.task_ids = model, tokenizer, bench, list(task_ids)
        self.s, self.name, self.out, self.decode = settings, name, GRPODir(out_dir), decode
        self.rollout = TokenRollout(bench, tokenizer, settings)
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        # each data-parallel process plays its own groups and keeps its own episode store
        self.store = TrajectoryStore(self.out.rollouts(self.rank if self.world > 1 else None))
        self.trainer = self.engine = None
        self.server = VllmRollouts(rollout_url, self.out.root / "vllm_adapter", f"grpo-{name}-r{self.rank}",
                                   stop_ids(tokenizer), settings.temperature) if rollout_url else None

    # -- generation backends
    def _generator(self, trainer) -> Generate:
        if trainer.use_vllm:  # trl syncs the LoRA-updated weights into vLLM before each rollout_func call
            return lambda seqs, n: trainer.vllm_generation.generate(seqs, None, 1)[1]
        if self.server:  # the adapter as it is now, pushed to the vLLM server; the step's turns are generated there
            self.server.push(trainer.accelerator.unwrap_model(trainer.model), trainer.state.global_step)
            return self.server.generate
        # the step's episodes decode together; each keeps its cache between turns, the group's
        # shared prompt is computed once; the weights changed since the last step: nothing is reused
        if self.engine is None:
            rows = self.s.group_size * self.s.groups_per_step // self.world
            self.engine = Engine(trainer.accelerator.unwrap_model(trainer.model), self.tok, rows=rows,
                                 max_len=self.s.max_seq_len + self.s.max_turn_tokens, compile=self.decode)
        self.engine.reset()
        return lambda seqs, n: self.engine.generate([Request(s, n, self.s.temperature) for s in seqs])

    def rollout_func(self, prompts: list, trainer) -> dict:
        """trl calls this with each group's prompt repeated G times; a prompt is the task id."""
        t0 = time.perf_counter()
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        try:
            generate = self._generator(trainer)
            tids = [p[-1]["content"] if isinstance(p, list) else str(p) for p in prompts]
            groups = [tids[i:i + self.s.group_size] for i in range(0, len(tids), self.s.group_size)]
            step = trainer.state.global_step
            hint = hinted_slots(self.s.group_size, self.s.hint_fraction)
            results: list[list[TokenEpisode] | None] = [None] * len(groups)
            todo = list(range(len(groups)))
            tasks = {g: groups[g][0] for g in todo}
            redrawn = 0
            for attempt in range(self.s.resample_constant_groups + 1):
                flat = [(g, tasks[g], h) for g in todo for h in hint[:len(groups[g])]]
                eps = self.rollout.run(generate, [t for _, t, _ in flat], [h for _, _, h in flat])
                for g in todo:
                    results[g] = [e for (gg, _, _), e in zip(flat, eps) if gg == g]
                todo = [g for g in todo if len({e.reward for e in results[g]}) == 1]
                if not todo or attempt == self.s.resample_constant_groups:
                    break
                for g in todo:
                    tasks[g] = redraw(self.task_ids, self.s.seed, step, self.rank, g, attempt)
                redrawn += len(todo)
            flat_eps = [e for r in results for e in r]
            metrics = trainer._metrics["train"]
            metrics["episode/success"].append(sum(e.success for e in flat_eps) / len(flat_eps))
            metrics["episode/turns"].append(sum(e.turns for e in flat_eps) / len(flat_eps))
            metrics["episode/redrawn_groups"].append(float(redrawn))
            metrics["episode/constant_groups"].append(float(len(todo)))
            metrics["time/rollout_s"].append(time.perf_counter() - t0)
            if self.s.log_kl and step % self.s.kl_every == 0 and hasattr(model, "disable_adapter"):
                t1 = time.perf_counter()
                metrics["kl_to_base"].append(kl_to_base(model, flat_eps))
                metrics["time/kl_s"].append(time.perf_counter() - t1)
            self._store(flat_eps, step)
        finally:
            model.train(was_training)
        return {"prompt_ids": [e.prompt_ids for e in flat_eps], "completion_ids": [e.completion_ids for e in flat_eps],
                "logprobs": None, "env_mask": [e.env_mask for e in flat_eps],
                "env_reward": [e.reward for e in flat_eps], "env_success": [float(e.success) for e in flat_eps]}

    def _store(self, eps: list[TokenEpisode], step: int) -> None:
        for i, e in enumerate(eps):
            self.store.add(Trajectory(task_id=e.task_id, benchmark=self.bench.name, trial=step * 10_000 + i,
                                      model=self.name, messages=e.messages, reward=e.reward, passed=e.success,
                                      termination=e.termination, steps=e.turns, split="train",
                                      reasons={"hinted": e.hinted, "step": step},
                                      completion_tokens=sum(e.env_mask)))

    # -- training
    def config(self):
        from trl import GRPOConfig

        s = self.s
        if s.groups_per_step % self.world:
            raise ValueError(f"grpo.groups_per_step={s.groups_per_step} must be a multiple of the {self.world} "
                             "training processes (each process plays whole groups); set groups_per_step to "
                             f"{self.world * max(1, s.groups_per_step // self.world)} or launch fewer processes")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        # the global batch (G x groups_per_step episodes) is the same for any number of processes
        return GRPOConfig(
            output_dir=str(self.out.checkpoints),
            per_device_train_batch_size=s.group_size * s.groups_per_step // self.world,
            num_generations=s.group_size, gradient_accumulation_steps=1, max_steps=s.steps,
            learning_rate=s.learning_rate, lr_scheduler_type="constant", warmup_steps=0, epsilon=s.epsilon,
            epsilon_high=s.epsilon_high, beta=s.beta, temperature=s.temperature,
            max_completion_length=s.max_turn_tokens, reward_weights=[1.0, 0.0], logging_steps=1,
            save_strategy="steps", save_steps=s.save_steps, report_to="none", seed=s.seed,
            data_seed=s.seed, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
            use_vllm=s.use_vllm, vllm_mode="colocate", dataloader_num_workers=0, disable_tqdm=False)

    def build(self):
        from datasets import Dataset
        from peft import LoraConfig
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        def env_reward(prompts, completions, env_reward, **_):
            return list(env_reward)

        def env_success(prompts, completions, env_success, **_):
            return list(env_success)

        s = self.s
        data = Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in self.task_ids]})
        lora = LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                          target_modules=s.lora_targets, task_type="CAUSAL_LM")
        self.trainer = _signal_only_trainer()(
            model=self.model, reward_funcs=[env_reward, env_success], args=self.config(), train_dataset=data,
            processing_class=self.tok, peft_config=lora, rollout_func=self.rollout_func,
            callbacks=[TensorBoardCallback(SummaryWriter(str(self.out.tensorboard)))])
        return self.trainer

    def train(self) -> TrainResult:
        trainer = self.trainer or self.build()
        last = last_complete_checkpoint(self.out.checkpoints) if trainer.accelerator.is_main_process else None
        trainer.accelerator.wait_for_everyone()
        last = last or last_complete_checkpoint(self.out.checkpoints, move_incomplete=False)
        if last and json.loads((Path(last) / "trainer_state.json").read_text())["global_step"] >= self.s.steps:
            # killed after the last step's checkpoint: resuming there would train one step too many
            from transformers.trainer_callback import TrainerState

            trainer._load_from_checkpoint(last)
            trainer.state = TrainerState.load_from_json(str(Path(last) / "trainer_state.json"))
        else:
            trainer.train(resume_from_checkpoint=last)
        # a skipped step's grad_norm is NaN (its `skipped_nonfinite_grad` says so): logged as null, since JSON has no NaN
        log = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
               for r in trainer.state.log_history if "reward" in r]
        adapter, curve = self.out.adapter, self.out.curve
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:  # rank 0 writes the results
            tmp = self.out.root / ".adapter.tmp"
            trainer.save_model(str(tmp))
            if adapter.exists():
                shutil.rmtree(adapter)
            tmp.rename(adapter)
            plot_curve(log, curve, f"GRPO: {self.name}")
            atomic_write_json(self.out.log, log)  # last: it marks the training finished
        trainer.accelerator.wait_for_everyone()  # every rank returns once the adapter is on disk
        return TrainResult(str(adapter), trainer.state.global_step, log, str(curve))


def last_complete_checkpoint(ckpt_dir: Path, move_incomplete: bool = True) -> str | None:
    """The newest checkpoint the trainer finished writing, or None. The trainer writes
    trainer_state.json last, so a kill while it saved leaves a `checkpoint-N` without a readable
    one: that folder is moved to `incomplete/` (kept, not deleted) so the step is saved again."""
    if not ckpt_dir.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir()
                   if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
    for step, path in reversed(found):
        try:
            if json.loads((path / "trainer_state.json").read_text())["global_step"] == step:
                return str(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if move_incomplete:
            dest = ckpt_dir / "incomplete" / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            dest.parent.mkdir(exist_ok=True)
            path.rename(dest)
    return None


def adapter_changed(adapter_dir: str | Path) -> bool:
    """Did training move the adapter? peft starts every LoRA B at zero, so an adapter whose B
    matrices are all still zero is exactly the base model (GRPO had no signal in any step)."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved adapter to inspect")
    lora_b = [t for k, t in load_file(str(path)).items() if "lora_B" in k]
    if not lora_b:
        raise ValueError(f"{path}: no lora_B weights; not a LoRA adapter")
    if not all(bool(t.isfinite().all()) for t in lora_b):  # NaN > 0 is False: never read NaN as "unchanged"
        raise DivergedAdapter(f"{path}: non-finite LoRA weights, the training diverged; train it again "
                              "(grpo.learning_rate lower) — this adapter is not the base and not usable")
    return any(bool(t.abs().max() > 0) for t in lora_b)


class DivergedAdapter(ValueError):
    """An adapter whose weights hold NaN or inf: neither trained nor the base."""


def plot_curve(log: list[dict], path: Path, title: str) -> None:
    """Reward, success, KL and episode length per step."""
    from trace_rl.core.figures import save_figure, subplots

    steps = [r.get("step", i + 1) for i, r in enumerate(log)]
    fig, axes = subplots(1, 3, figsize=(11, 3.2))
    for key, label in [("reward", "reward"), ("rewards/env_success/mean", "success")]:
        axes[0].plot(steps, [r.get(key, float("nan")) for r in log], marker=".", label=label)
    mean, std = [r.get("reward") or 0 for r in log], [r.get("reward_std") or 0 for r in log]  # null: not finite
    axes[0].fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.15)
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=8)
    kl = [(x, r["kl_to_base"]) for x, r in zip(steps, log) if "kl_to_base" in r]  # every kl_every steps
    axes[1].plot([x for x, _ in kl], [k for _, k in kl], marker=".", color="tab:red")
    if not kl:
        axes[1].text(0.5, 0.5, "not logged (grpo.log_kl off)", ha="center", va="center", transform=axes[1].transAxes)
    axes[2].plot(steps, [r.get("completions/mean_length", float("nan")) for r in log], marker=".", color="tab:green")
    for ax, heading in zip(axes, ["reward (±std) and success", "KL(policy || base)", "episode tokens after the prompt"]):
        ax.set_title(heading, fontsize=9)
        ax.set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
