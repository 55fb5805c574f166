"""Mixture of LoRA experts with a learned token-level top-1 router (TRACE §5).

The base model is loaded once; every adapted Linear carries all n adapters. Each decoder
layer has a gate `Linear(hidden, 1 + n)`: slot 0 is the base model (bias 5.0, so routing
starts at "no adapter"), slots 1..n the adapters. Per token: k = argmax of the gate,
g = softmax(gate)[k], and  y = W x + g · B_k A_k x  (nothing added for k = 0).
The routed low-rank update is one fused computation over all experts (x A_cat^T, masked
per token, then B_cat), not a loop over tokens or experts. Gate training uses a straight-
through estimator: hard top-1 forward, the dense mixture's gradient backward.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trace_rl.core.io import atomic_write, atomic_write_json
from trace_rl.core.rundir import CompositionDir
from trace_rl.models.fuse import small_matmul

BASE_BIAS = 5.0


@dataclass
class Adapter:
    """One LoRA adapter as plain tensors: {module path: (A [r, in], B [out, r])}, scaling = alpha / r."""
    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    @classmethod
    def from_peft(cls, name: str, peft_model) -> "Adapter":
        """Read the active adapter of a peft model (LoRA on Linear layers)."""
        weights, scaling = {}, None
        for path, mod in peft_model.named_modules():
            if name in getattr(mod, "lora_A", {}):
                base_path = path.replace("base_model.model.", "", 1)
                weights[base_path] = (mod.lora_A[name].weight.detach().clone(), mod.lora_B[name].weight.detach().clone())
                scaling = mod.scaling[name]
        if not weights:
            raise ValueError(f"adapter {name!r} has no LoRA Linear layers in this model")
        return cls(name, weights, float(scaling))

    @classmethod
    def from_dir(cls, name: str, path: str | Path) -> "Adapter":
        """Read a peft LoRA adapter folder (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        scaling = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
        tensors = load_file(str(path / "adapter_model.safetensors"))
        weights = {key.removesuffix(".lora_A.weight").replace("base_model.model.", "", 1):
                   (A, tensors[key.replace(".lora_A.", ".lora_B.")]) for key, A in tensors.items()
                   if key.endswith(".lora_A.weight")}
        if not weights:
            raise ValueError(f"{path} holds no LoRA A/B weights")
        return cls(name, weights, float(scaling))


@dataclass
class Routing:
    """Per-layer routing decisions, shared by the gate and that layer's Linears."""
    rank: int  # the adapters' LoRA rank
    route: torch.Tensor | None = None  # [batch, seq] long, 0 = base
    probs: torch.Tensor | None = None  # [batch, seq, 1 + n]
    force: int | None = None  # force every token to one slot (tests, the router's scoring)
    row_bias: torch.Tensor | None = None  # [batch, 1 + n] added to the gate's logits (set by `LoRAMoE.route_rows`)
    mask: torch.Tensor | None = None  # [batch, seq, n]: g on the chosen adapter, 0 on the others

    def weigh(self, down: torch.Tensor) -> torch.Tensor:
        """`down` ([..., m * n * rank]: the down-projections of m projections' n experts) with each
        expert's rank slots scaled by its mask value; broadcast, so the mask is never repeated."""
        n = self.mask.shape[-1]
        return (down.unflatten(-1, (-1, n, self.rank)) * self.mask.to(down.dtype)[..., None, :, None]).flatten(-3)


class RoutedLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, weights: list[tuple[torch.Tensor, torch.Tensor]], scaling: list[float],
                 routing: Routing):
        super().__init__()
        self.base, self.routing = base, routing
        dev, dt = base.weight.device, base.weight.dtype
        # Fold each adapter's scaling into its B; stack: A_cat [n*r, in], B_cat [out, n*r]
        self.register_buffer("A_cat", torch.cat([A for A, _ in weights], 0).to(dev, dt))
        self.register_buffer("B_cat", torch.cat([B * s for (_, B), s in zip(weights, scaling)], 1).to(dev, dt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.routing.mask is None:
            return y
        # no data-dependent branch (a .any() here would sync GPU->CPU 4x per layer per token)
        return small_matmul(self.routing.weigh(x @ self.A_cat.T), self.B_cat, plus=y)


class LayerGate(nn.Module):
    def __init__(self, hidden: int, n: int, routing: Routing):
        super().__init__()
        self.proj = nn.Linear(hidden, 1 + n)
        nn.init.zeros_(self.proj.weight)
        with torch.no_grad():
            self.proj.bias.zero_()
            self.proj.bias[0] = BASE_BIAS
        self.routing = routing
        self.register_buffer("adapter_slots", torch.arange(1, 1 + n), persistent=False)

    def decide(self, layer, args, kwargs) -> None:
        """The decoder layer's forward pre-hook: route the tokens of its input.

        Few operations on purpose: at batch 1 each is a kernel launch, and they run in every layer."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if torch.compiler.is_compiling() and not torch.is_grad_enabled() and self.routing.force is None:
            return self._decide_by_slot(hidden)
        logits = small_matmul(hidden.to(self.proj.weight.dtype), self.proj.weight, plus=self.proj.bias)
        if self.routing.row_bias is not None:
            logits = logits + self._row_bias(logits.dim())
        probs = logits.softmax(-1)
        gate, route = probs.max(-1)  # multiplicative gating by the chosen slot's probability
        if self.routing.force is not None:
            route = torch.full_like(route, self.routing.force)
            gate = torch.ones_like(gate)
        self.routing.route, self.routing.probs = route, probs
        sel = self._mask(route, gate, hidden.dtype)
        if torch.is_grad_enabled() and self.routing.force is None:
            # Straight-through: the forward value stays hard top-1 (exactly what inference runs),
            # the gradient is the dense mixture's, Σ_k p_k B_k A_k x. With hard top-1 alone, tokens
            # on slot 0 (where every token starts, bias 5.0) would give the gates no gradient.
            soft = probs[..., 1:].to(sel.dtype)
            sel = sel.detach() + soft - soft.detach()
        self.routing.mask = sel  # shared by the layer's Linears

    def _decide_by_slot(self, hidden: torch.Tensor) -> None:
        """`decide` written for inductor (decoding): one reduction over the hidden size per slot,
        then the softmax's max and sum over the 1 + n slots as elementwise operations on those.
        Each reduction has the loop of the layer's RMSNorm over the same input, so inductor fuses
        the whole decision into that kernel; as a GEMV and a softmax over 5 columns it was five
        kernels of its own per layer (benchmarks/decode_ops.py --compiled). Same decision as
        `decide`: the first slot of largest probability (logits that differ by less than a
        probability can show tie there too), weighted by that probability."""
        h, w, b = hidden.to(self.proj.weight.dtype), self.proj.weight, self.proj.bias
        logits = [(h * w[j]).sum(-1) + b[j] for j in range(w.shape[0])]
        if self.routing.row_bias is not None:
            bias = self._row_bias(h.dim())
            logits = [logit + bias[..., j] for j, logit in enumerate(logits)]
        top = reduce(torch.maximum, logits)
        exps = [torch.exp(logit - top) for logit in logits]
        total = reduce(torch.add, exps)
        probs = [e / total for e in exps]
        gate = reduce(torch.maximum, probs)
        first, taken = [], torch.zeros_like(top, dtype=torch.bool)
        for p in probs:  # max's tie rule: the first slot at the maximum
            first.append((p == gate) & ~taken)
            taken = taken | first[-1]
        route = reduce(torch.add, [j * f.long() for j, f in enumerate(first)])
        self.routing.route, self.routing.probs = route, torch.stack(probs, -1)
        # the mask from the route, not a stack of per-slot masks (that stack is a kernel of its own)
        self.routing.mask = self._mask(route, gate, hidden.dtype)

    def _row_bias(self, dim: int) -> torch.Tensor:
        """`route_rows`' [batch, 1 + n] bias, viewed to broadcast over logits of `dim` dimensions."""
        return self.routing.row_bias.view(-1, *[1] * (dim - 2), self.routing.row_bias.shape[-1])

    def _mask(self, route: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[.., n]: the gate value on the chosen adapter, 0 elsewhere. By comparison (no host sync: the
        step may be replayed as a CUDA graph); a where, not a product, so a NaN gate (a row whose
        logits are all -inf) leaves every slot at 0."""
        return torch.where(route.unsqueeze(-1) == self.adapter_slots, gate.to(dtype).unsqueeze(-1), 0)


def _decoder_layers(model) -> nn.ModuleList:
    for path in ("model.layers", "model.model.layers", "transformer.h"):
        try:
            return reduce(getattr, path.split("."), model)
        except AttributeError:
            continue
    raise ValueError("cannot find the decoder layers of this model")


class LoRAMoE(nn.Module):
    """A frozen base with n LoRA experts and one trainable gate per decoder layer."""

    def __init__(self, model, adapters: list[Adapter]):
        super().__init__()
        if not adapters:
            raise ValueError("LoRAMoE needs at least one adapter")
        self.model, self.adapters = model, adapters
        for p in model.parameters():
            p.requires_grad_(False)
        self.gates = nn.ModuleList()
        modules = dict(model.named_modules())
        targets = set(adapters[0].weights)
        ranks = {A.shape[0] for a in adapters for A, _ in a.weights.values()}
        if odd := [a.name for a in adapters if set(a.weights) != targets]:
            raise ValueError(f"adapter {odd[0]} targets other modules than {adapters[0].name}")
        if len(ranks) != 1:
            raise ValueError(f"adapters must share one LoRA rank to be fused; got ranks {sorted(ranks)}")
        prefix = {id(m): name for name, m in modules.items()}
        for layer in _decoder_layers(model):
            routing = Routing(rank=next(iter(ranks)))
            gate = LayerGate(model.config.hidden_size, len(adapters), routing).to(next(model.parameters()).device)
            self.gates.append(gate)
            layer.register_forward_pre_hook(gate.decide, with_kwargs=True)
            for path in [p for p in targets if p.startswith(prefix[id(layer)] + ".")]:
                parent_path, attr = path.rsplit(".", 1)
                parent = modules[parent_path]
                setattr(parent, attr, RoutedLoRALinear(getattr(parent, attr), [a.weights[path] for a in adapters],
                                                       [a.scaling for a in adapters], routing))
        self.routings = [g.routing for g in self.gates]

    def force(self, slot: int | None) -> None:
        """Route every token to `slot` (0 = base, k = adapter k), or None for learned routing."""
        for r in self.routings:
            r.force = slot

    def route_rows(self, slots: torch.Tensor | None) -> None:
        """Per batch row: slot k (0 = base), or -1 for the learned gates; None: per-row routing off.
        The engine sets it around each forward of a batch that mixes modes (router, moe, ...).
        A fixed row's other slots get -inf on their gate logits, so its slot's probability, the g
        it is weighted by, is exactly 1: one add per layer, computed here once per forward."""
        bias = None
        if slots is not None:
            others = torch.arange(1 + len(self.adapters), device=slots.device) != slots[:, None]
            bias = torch.zeros(others.shape, device=slots.device).masked_fill(others & (slots[:, None] >= 0), -torch.inf)
        for r in self.routings:
            r.row_bias = bias

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def load_balance_loss(self) -> torch.Tensor:
        """Switch-style: (1 + n) · Σ_i f_i · P_i, averaged over layers."""
        losses = []
        for r in [r for r in self.routings if r.probs is not None]:  # layers that ran
            n1 = r.probs.shape[-1]
            f = F.one_hot(r.route, n1).float().mean(dim=tuple(range(r.route.dim())))
            p = r.probs.float().mean(dim=tuple(range(r.probs.dim() - 1)))
            losses.append(n1 * (f * p).sum())
        return torch.stack(losses).mean()

    def gate_parameters(self):
        return self.gates.parameters()

    def save(self, path: str | Path, **manifest) -> None:
        """One artefact: adapters + gates + manifest (with `manifest`'s extra fields)."""
        atomic_write(CompositionDir(path).weights, lambda tmp: torch.save({
            "gates": self.gates.state_dict(),
            "adapters": [{"name": a.name, "scaling": a.scaling, "weights": a.weights} for a in self.adapters]}, tmp))
        atomic_write_json(CompositionDir(path).manifest, {  # last: a manifest means the artefact is whole
            "adapters": [a.name for a in self.adapters], "n_layers": len(self.gates),
            "targets": sorted(self.adapters[0].weights), "base_bias": BASE_BIAS,
            "gate_parameters": sum(p.numel() for p in self.gates.parameters()), **manifest})

    @classmethod
    def load(cls, model, path: str | Path) -> "LoRAMoE":
        # onto the model's device: a composition made on a GPU loads on a CPU machine (resume continues on either)
        blob = torch.load(CompositionDir(path).weights, weights_only=False, map_location=next(model.parameters()).device)
        moe = cls(model, [Adapter(a["name"], a["weights"], a["scaling"]) for a in blob["adapters"]])
        moe.gates.load_state_dict(blob["gates"])
        return moe


def adapter_share(moe: LoRAMoE, batches) -> float:
    """The share of (token, layer) routes that go to an adapter on `batches` (gate training's rows), after
    training. 0 means every gate still prefers the base slot, where BASE_BIAS starts it: the moe decodes as the
    base, and its row says nothing about the adapters."""
    moe.force(None)
    device, routed, total = next(moe.model.parameters()).device, 0, 0
    with torch.no_grad():
        for batch in batches:
            moe(**{k: v.to(device) for k, v in batch.items() if k != "labels"})
            seen = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).to(device).bool()
            for r in moe.routings:
                routed += int((r.route[seen] > 0).sum())
                total += int(seen.sum())
    return routed / total if total else 0.0


def train_gates(moe: LoRAMoE, batches, epochs: int = 3, lr: float = 5e-4, weight_decay: float = 0.01,
                lb_weight: float = 1e-3, checkpointing: bool = True) -> list[float]:
    """Gate training on successful rollouts: token cross-entropy + λ · load balance.
    `batches`: iterable of dicts with input_ids, attention_mask, labels (-100 = not trained).
    τ² episodes run to 4.5-6k tokens (the policy alone is most of it), and a gate's gradient flows
    back through every later layer: `checkpointing` recomputes each decoder layer in the backward
    pass instead of keeping every layer's activations (43-46 % less memory at 6-12k tokens,
    benchmarks/gate_training.py)."""
    opt = torch.optim.AdamW(moe.gate_parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    moe.force(None)
    model, was_training = moe.model, moe.model.training
    checkpointing = checkpointing and getattr(model, "supports_gradient_checkpointing", False)
    if checkpointing:  # HF checkpoints layers only in train mode (which would switch on a base's dropout; Qwen2.5 has 0.0)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    device = next(model.parameters()).device  # rows are built on the CPU; the model may sit on a GPU
    try:
        for _ in range(epochs):
            for batch in batches:
                loss = moe(**{k: v.to(device) for k, v in batch.items()}).loss + lb_weight * moe.load_balance_loss()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
    finally:
        if checkpointing:
            model.gradient_checkpointing_disable()
            model.train(was_training)
    return losses
