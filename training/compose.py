"""Composition at inference (TRACE §5): the base loaded once with every capability adapter,
evaluated four ways through the same agent loop:

- `base`      every token on slot 0 (exactly the base model);
- `<name>`    every token on one adapter (exactly that single LoRA);
- `router`    the baseline: the base model, asked as a classifier over the capability
              descriptions plus "base", picks one adapter per conversation (top-1);
- `moe`       the learned token-level top-1 gates.

`compose()` trains the gates on successful rollouts and saves one artefact (adapters +
gates + manifest); `load()` brings it back for evaluation or serving.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from trace_rl import prompts
from trace_rl.core.records import Capability
from trace_rl.core.rundir import CompositionDir, TrainDir
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.models.engine import Engine
from trace_rl.models.hf_policy import HFPolicy, assistant_labels, encode, render
from trace_rl.training.moe import Adapter, LoRAMoE, adapter_share, train_gates

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def task_text(messages: list[dict], budget: int = 1500) -> str:
    """What the router reads: the end of the system prompt (tickets sit there in telecom solo
    mode) and the user's first message (where airline/retail users state the task)."""
    system = next((m.get("content") or "" for m in messages if m["role"] == "system"), "")
    user = next((m.get("content") or "" for m in messages if m["role"] == "user"), "")
    return (("..." + system[-budget:]) if len(system) > budget else system) + "\n\n" + user[:budget]


class ClassifierRouter:
    """Top-1 per conversation: the option the base model scores highest as the next letter.

    Small models favour a letter whatever the task, so the capabilities are shown in every cyclic order and each one's
    log-probability is averaged over the positions it took (base stays option A)."""

    def __init__(self, moe: LoRAMoE, tokenizer, capabilities: list[Capability]):
        if len(capabilities) + 1 > len(LETTERS):
            raise ValueError(f"the router handles at most {len(LETTERS) - 1} capabilities")
        self.moe, self.tok, self.caps = moe, tokenizer, capabilities
        self.letter_ids = [encode(tokenizer, letter)[0] for letter in LETTERS[:len(capabilities) + 1]]

    def prompt(self, messages: list[dict], order: list[int] | None = None) -> str:
        order = list(range(len(self.caps))) if order is None else order
        options = ["A) base: none of the capabilities below is needed"] + [
            f"{LETTERS[pos + 1]}) {self.caps[i].name}: {self.caps[i].description}" for pos, i in enumerate(order)]
        text = prompts.load("router", task=task_text(messages), options="\n".join(options))
        return render(self.tok, [{"role": "user", "content": text}], add_generation_prompt=True)

    def scores(self, messages: list[dict]) -> list[float]:
        """Mean log-probability per slot (0 = base, k = adapter k), over the cyclic orders."""
        n = len(self.caps)
        total = torch.zeros(n + 1)
        device = next(self.moe.parameters()).device
        self.moe.force(0)  # scored on the base model alone
        try:
            for shift in range(max(1, n)):
                order = [(i + shift) % n for i in range(n)]
                ids = torch.tensor([encode(self.tok, self.prompt(messages, order))], device=device)
                with torch.no_grad():
                    logp = torch.log_softmax(self.moe(input_ids=ids).logits[0, -1][self.letter_ids].float(), -1).cpu()
                total[[0, *(i + 1 for i in order)]] += logp  # option A is base, then the capabilities in `order`
        finally:
            self.moe.force(None)
        return (total / max(1, n)).tolist()

    def choose(self, messages: list[dict]) -> int:
        """0 = base, k = adapter k."""
        s = self.scores(messages)
        return max(range(len(s)), key=s.__getitem__)


class Composition:
    """One base model with n adapters; `policy(mode)` gives an agent policy for each mode."""

    def __init__(self, moe: LoRAMoE, tokenizer, capabilities: list[Capability], name: str = "composed",
                 max_new_tokens: int = 256, rows: int | None = None, max_len: int = 16384, decode: str = "auto"):
        self.moe, self.tok, self.caps, self.name = moe, tokenizer, capabilities, name
        self.modes = _modes(capabilities)
        self.router = ClassifierRouter(moe, tokenizer, capabilities)
        self.max_new_tokens = max_new_tokens
        self.routes: dict[str, int] = {}  # conversation -> chosen slot (router mode): chosen once
        cuda = next(moe.parameters()).device.type == "cuda"
        # one engine for every mode: a row's tag is its slot (0 base, k adapter k, -1 the learned gates)
        self.engine = Engine(moe.model, tokenizer, rows=rows or (16 if cuda else 1), max_len=max_len,
                             before_forward=moe.route_rows, compile=decode)

    def route(self, messages: list[dict]) -> int:
        """The router's slot for this conversation, chosen once per task text."""
        key = task_text(messages)
        if key not in self.routes:
            with self.engine.lock:  # its forward must not interleave with the engine's
                self.routes[key] = self.router.choose(messages)
        return self.routes[key]

    def route_counts(self, conversations: list[list[dict]]) -> dict[str, int]:
        """{mode: episodes the router sent there} over the router row's `conversations` (message lists):
        what the row actually ran. A conversation routed before a resume is decided again (the same
        scoring of the same text)."""
        return dict(Counter(self.modes[self.route(messages)] for messages in conversations))

    def policy(self, mode: str) -> HFPolicy:
        if mode not in self.modes:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(self.modes)}")
        if mode == "router":
            tag = lambda messages, tools: self.route(messages)  # noqa: E731
        else:  # a fixed slot, its index in `modes` (0 = base, k = adapter k), or -1: the learned gates
            slot = -1 if mode == "moe" else self.modes.index(mode)
            tag = lambda messages, tools: slot
        return HFPolicy(self.moe.model, self.tok, f"{self.name}:{mode}", max_new_tokens=self.max_new_tokens,
                        engine=self.engine, tag=tag)


def gate_examples(tokenizer, conversations: list[tuple[list[dict], list[dict]]],
                  max_len: int = 16384) -> tuple[list[dict], int]:
    """(messages, tools) of successful rollouts -> (gate-training rows with labels on assistant tokens,
    how many were left out for running past `max_len` tokens). Never cut: a cut tail drops the
    assistant turns, a cut head the context the gates must route on."""
    rows, too_long = [], 0
    for messages, tools in conversations:
        ids, labels = assistant_labels(tokenizer, messages, tools)
        if len(ids) > max_len:
            too_long += 1
        elif any(l != -100 for l in labels):
            rows.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
    return rows, too_long


def compose(model, tokenizer, adapters: dict[str, str | Path], capabilities: list[Capability],
            conversations: list[tuple[list[dict], list[dict]]], out_dir: str | Path, epochs: int = 3,
            lr: float = 5e-4, weight_decay: float = 0.01, lb_weight: float = 1e-3, max_len: int = 16384,
            sources: dict[str, int] | None = None) -> LoRAMoE:
    """Build the MoE from trained adapters, train its gates on successful rollouts
    (token cross-entropy + load balance, TRACE §5 defaults) and save one artefact.
    `sources`: how many of `conversations` each capability's environment gave (kept in the manifest)."""
    moe = LoRAMoE(model, [Adapter.from_dir(name, path) for name, path in adapters.items()])
    rows, too_long = gate_examples(tokenizer, conversations, max_len)
    losses = train_gates(moe, rows, epochs=epochs, lr=lr, weight_decay=weight_decay, lb_weight=lb_weight) if rows else []
    share = adapter_share(moe, rows) if losses else None
    moe.save(out_dir, capabilities=[c.model_dump() for c in capabilities], gate_training={
        "examples": len(rows), "offered": len(conversations), "too_long": too_long, "max_len": max_len,
        "epochs": epochs, "lr": lr, "weight_decay": weight_decay, "lb_weight": lb_weight,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "adapter_share": share,
        "from": sources or {}})
    return moe


def _modes(caps: list[Capability]) -> list[str]:
    return ["base", *[c.name for c in caps], "router", "moe"]


def _capabilities(path: str | Path) -> list[Capability]:
    manifest = json.loads(CompositionDir(path).manifest.read_text())
    return [Capability.model_validate(c) for c in manifest.get("capabilities") or []] or [
        Capability(name=n, description=n) for n in manifest["adapters"]]


def load(model, tokenizer, path: str | Path, **kw) -> Composition:
    """A saved composition (see `compose`) on an already loaded base model."""
    return Composition(LoRAMoE.load(model, path), tokenizer, _capabilities(path), **kw)


def saved_modes(path: str | Path) -> list[str]:
    """The modes of a saved composition, read from its manifest without loading a model."""
    return _modes(_capabilities(path))


def _gate_training(composition_dir: str | Path) -> dict:
    """The manifest's record of gate training ({} for a composition saved before there was one)."""
    return json.loads(CompositionDir(composition_dir).manifest.read_text()).get("gate_training") or {}


def _untrained_because(g: dict) -> str | None:
    if g.get("examples") and g.get("loss_first") is None:  # compose.epochs = 0: examples, but no step taken
        return f"0 gate steps ({g.get('epochs')} epochs on {g['examples']} successful rollouts)"
    if g.get("examples"):
        return None
    if g.get("too_long"):
        rest = g["offered"] - g["too_long"]
        return (f"{'all ' if not rest else ''}{g['too_long']} of {g['offered']} successful rollouts run past "
                f"max_len={g['max_len']} tokens" + (f"; the other {rest} hold no assistant token" if rest else ""))
    if g.get("offered"):
        return f"none of {g['offered']} successful rollouts holds an assistant token"
    return "0 successful rollouts to train them on"


def gates_untrained(composition_dir: str | Path) -> str | None:
    """Why a composition's gates saw no example (its moe routes every token to the base, slot 0), or None."""
    return _untrained_because(_gate_training(composition_dir))


def gate_summary(composition_dir: str | Path) -> str:
    """What the gates trained on and how their loss moved: the moe row is read against it."""
    g = _gate_training(composition_dir)
    if why := _untrained_because(g):
        return f"gates untrained: {why}"
    where = ", ".join(f"{k}: {v}" for k, v in (g.get("from") or {}).items())
    share = g.get("adapter_share")  # None for a composition saved before it was measured
    routes = "" if share is None else f"; {share:.0%} of token routes to an adapter" + (
        " (every gate still prefers the base: the moe decodes as the base)" if share == 0 else "")
    return (f"gates trained on {g['examples']} successful rollouts" + (f" ({where})" if where else "")
            + f", {g['epochs']} epochs, loss {g['loss_first']:.3f} → {g['loss_last']:.3f}" + routes)


def adapter_names(adapters: dict) -> dict[str, str]:
    """{capability: the mode its adapter is composed and evaluated under} for every adapter that changed in
    training ({capability: AdapterRecord}): named after what it trained on; two capabilities substituted by
    one library env keep apart."""
    names: dict[str, str] = {}
    taken = {"base", "router", "moe", "grpo_target"}  # the table's other rows
    for k, v in adapters.items():
        if v.adapter and not v.untrained:
            name = v.trained_on.name
            names[k] = name if name not in taken | set(names.values()) else f"{name}@{k}"
    return names


def compose_trained(adapters: dict, train: Callable[[str], TrainDir], out_dir: str | Path, load_base, log=print,
                    **gate_training) -> tuple[str | None, str | None]:
    """The compose stage: every adapter that changed in training ({capability: AdapterRecord}; `train(name)`: the
    folder it was trained in),
    named and described after what it trained on, gates trained (compose()'s settings) on the
    successful GRPO and held-out episodes. Returns (composition dir, why its gates are untrained or None),
    or (None, None) when no adapter changed. Reuses a saved composition of the same adapters."""
    names = adapter_names(adapters)
    trained = {k: adapters[k] for k in names}
    if not trained:
        log("compose: SKIPPED: no adapter changed during training; the final table has the base model only")
        return None, None
    out = Path(out_dir)
    manifest = CompositionDir(out).manifest
    if manifest.is_file():  # reused only when made from the same adapters with the same gate settings
        saved = json.loads(manifest.read_text())
        if saved["adapters"] == list(names.values()) and all(
                (saved.get("gate_training") or {}).get(k) == v for k, v in gate_training.items()):
            return str(out), gates_untrained(out)
    convs, sources = [], {}
    for name in trained:
        folder = train(name)
        tools = json.loads(folder.tools.read_text())
        before = len(convs)
        for store in (folder.grpo.rollouts(), folder.heldout("after")):
            convs += [(t.messages, tools) for t in TrajectoryStore(store).all() if t.passed]
        sources[names[name]] = len(convs) - before
    model, tok = load_base()
    caps = [Capability(name=names[n], description=v.trained_on.description or n) for n, v in trained.items()]
    compose(model, tok, {names[n]: v.adapter for n, v in trained.items()}, caps, convs, out, sources=sources,
            **gate_training)
    if why := gates_untrained(out):
        log(f"compose: GATES UNTRAINED: {why}; the moe row routes every token to the base")
    return str(out), why
