"""Stacked projections for decoding: one GEMM per attention block for q, k and v, and one per MLP
for gate and up, instead of one per projection.

At batch 1 a small projection's GEMM costs its launch, not its weight reads (measured in
benchmarks/README.md, benchmarks/decode_profile.py). Stacking reads the same bytes in one launch.

The group's first module (the one the model calls first: q, gate) computes every member's output;
the others take their part when called with the same input (the last one lets go of it) and
compute their own otherwise. The members' weights become views of the stacked weight, so nothing
is copied, the state dict is unchanged and an in-place update of a member reaches the stack. A
peft LoRA around a member still adds its update on top. The MoE's routed LoRA (training/moe.py)
joins the stack: its experts' A rows are stacked under the weights (one GEMM for the base and
every expert's down-projection) and their B blocks form one block-diagonal up-projection; a
routed projection in no group (o_proj) is stacked on its own, with its experts' A rows.
While gradients are being recorded for a trainable member, every member computes its own product
(through the stack, its parameter would get no gradient).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SUM_ROWS = 8  # up to this many rows a thin product is a multiply-sum while compiling (small_matmul)


def small_matmul(a: torch.Tensor, w: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
    """`plus + a @ w.T` for a thin product (a gate, a LoRA's up-projection), in one operation.
    While compiling for a few rows it is written as a multiply and a sum: inductor fuses that with
    its producers (the routing mask) and `plus` into one kernel, where a GEMM would be a launch of
    its own, and at batch 1 a launch costs more than the product."""
    if torch.compiler.is_compiling() and a.numel() // a.shape[-1] <= SUM_ROWS:
        out = (a.unsqueeze(-2).float() * w.float()).sum(-1)
        return (out if plus is None else out + plus).to(a.dtype if plus is None else plus.dtype)
    if plus is None or plus.dim() == 1:
        return F.linear(a, w, plus)
    return torch.addmm(plus.flatten(0, -2), a.flatten(0, -2), w.T).view(plus.shape)


def _linear(module) -> nn.Linear | None:
    """The plain Linear under a peft LoRA (`base_layer`) or the MoE's routed LoRA (`base`)."""
    while module is not None and not isinstance(module, nn.Linear):
        module = getattr(module, "base_layer", getattr(module, "base", None))
    return module


class _Stack:
    """One group: the stacked weight and bias, and the parts of the last input's product."""

    def __init__(self, modules: list[nn.Module]):
        self.modules, self.linears = modules, [_linear(m) for m in modules]
        self.sizes = [lin.out_features for lin in self.linears]
        routed = {id(m.routing) for m in modules if hasattr(m, "A_cat")}
        self.routing = modules[0].routing if len(routed) == 1 and all(hasattr(m, "A_cat") for m in modules) else None
        self.weight = torch.cat([w.detach() for w in self._rows()])
        self.bias = None
        if any(lin.bias is not None for lin in self.linears):
            self.bias = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(n)
                                   for lin, n in zip(self.linears, self.sizes)])
            self.bias = F.pad(self.bias, (0, self.weight.shape[0] - self.bias.shape[0]))
        if self.routing:  # [sum of outputs, members * experts * rank]: member i's B on its own block
            self.up = torch.block_diag(*[m.B_cat for m in modules])
        self.x, self.parts = None, ()
        self.refresh()

    def _rows(self) -> list[torch.Tensor]:
        """The tensors stacked into `weight`, in order: each member's weight, then its experts' A rows."""
        return [lin.weight for lin in self.linears] + ([m.A_cat for m in self.modules] if self.routing else [])

    def _views(self):
        """(member tensor, its slice of the stack) for every stacked weight, bias and expert."""
        rows = self._rows()
        pairs = list(zip(rows, self.weight.split([w.shape[0] for w in rows])))
        if self.bias is not None:
            pairs += [(lin.bias, b) for lin, b in zip(self.linears, self.bias[:sum(self.sizes)].split(self.sizes))
                      if lin.bias is not None]
        if self.routing:  # member i's B: its block of the block-diagonal up-projection
            k = self.modules[0].B_cat.shape[1]
            pairs += [(m.B_cat, self.up[a:a + n, i * k:(i + 1) * k])
                      for i, (m, a, n) in enumerate(zip(self.modules, [0, *itertools.accumulate(self.sizes)], self.sizes))]
        return pairs

    def refresh(self) -> None:
        """Make every member's tensor a view of the stack again, keeping its current values (a
        member's `.data` may have been replaced: a reload, a merge). The stack keeps its address,
        so a captured CUDA graph reads the new values."""
        with torch.no_grad():
            for t, view in self._views():
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t)
                    t.data = view

    def member(self, i: int):
        original = (self.modules[i] if self.routing else self.linears[i]).forward  # the member's own product
        last = i == len(self.modules) - 1

        def forward(x: torch.Tensor) -> torch.Tensor:
            if i == 0:
                if torch.is_grad_enabled() and any(p.requires_grad for p in self.weights()):
                    return original(x)
                parts = self._product(x).split(self.sizes, -1)
                if not last:
                    self.x, self.parts = x, parts
                return parts[0]
            if x is not self.x:
                return original(x)
            part = self.parts[i]
            if last:
                self.x, self.parts = None, ()
            return part
        return forward

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.routing:
            return y
        n = sum(self.sizes)
        y, down = y[..., :n], y[..., n:]
        if self.routing.mask is None:
            return y
        return small_matmul(self.routing.weigh(down), self.up, plus=y)

    def weights(self):
        return [p for lin in self.linears for p in lin.parameters()]


def _groups(model):
    """The modules to stack together: q/k/v and gate/up of every block; then, on its own, each
    routed LoRA no group took (o_proj), so its experts' A rows join its own weight. Lazy: the
    second part is read after the first was stacked."""
    for block in model.modules():
        for names in GROUPS:
            yield [getattr(block, n, None) for n in names]
    for m in list(model.modules()):
        if hasattr(m, "A_cat"):
            stack = getattr(m.base, "stack", None)
            if stack is None or stack.modules == [m]:  # not in a group's stack
                yield [m]


def fuse_projections(model) -> int:
    """Stack q/k/v and gate/up in every block of `model` that has them, and each routed LoRA in no
    group on its own (in place); returns the number of groups newly stacked. Called again, it re-links tensors replaced since (`refresh`)."""
    done = 0
    for modules in _groups(model):
        linears = [_linear(m) for m in modules]
        if any(lin is None for lin in linears):
            continue
        if all(hasattr(lin, "stack") for lin in linears):  # stacked before: re-link replaced tensors
            linears[0].stack.refresh()
            continue
        if any(hasattr(lin, "stack") for lin in linears):
            continue
        if len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
            continue
        stack = _Stack(modules)
        for i, lin in enumerate(linears):
            lin.stack = stack
            (modules[i] if stack.routing else lin).forward = stack.member(i)
        done += 1
    return done
