"""Operations per decode step, counted on any device (CPU included): what a launch-bound GPU step
pays for, one kernel each in eager or CUDA-graph mode. Counts the aten operations of one
one-token forward that compute something (views and reshapes excluded), for the base model and
the 4-expert MoE, and prints the MoE's extra operations per layer.

    python benchmarks/decode_ops.py [--config tiny|0.5b|1.5b]   (run from benchmarks/ or with it on PYTHONPATH)
"""
import argparse
import collections

import torch
from moe_throughput import models
from torch.utils._python_dispatch import TorchDispatchMode

from trace_rl.training.fuse import fuse_projections

VIEWS = ("view", "slice", "unsqueeze", "aten.t.", "transpose", "permute", "split", "expand", "squeeze", "alias",
         "_unsafe_view", "lift_fresh", "detach", "unflatten", "flatten")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(v in str(func) for v in VIEWS):
            self.ops[str(func).removeprefix("aten.").removesuffix(".default")] += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    args = ap.parse_args()
    nets = models(args.config, torch.device("cpu"), ["base", "moe"])
    counts = {}
    for name, net in nets.items():
        if name not in ("base", "moe"):
            continue
        fuse_projections(net.model if name == "moe" else net)  # as the engine's compiled steps run it
        with torch.no_grad(), CountOps() as c:
            if name == "moe":
                net.route_rows(torch.tensor([-1]))  # the engine's per-row routing (the gates decide), once per step
            net(input_ids=torch.tensor([[5]]))
        counts[name] = c.ops
    layers = nets["base"].config.num_hidden_layers
    extra = counts["moe"] - counts["base"]
    print(f"Qwen2.5-{args.config} shape, one decode token: base {sum(counts['base'].values())} ops, "
          f"MoE {sum(counts['moe'].values())} ops, {(sum(counts['moe'].values()) - sum(counts['base'].values())) / layers:.1f} "
          f"extra per layer")
    print("extra per layer:", ", ".join(f"{op} {n / layers:.2g}" for op, n in extra.most_common()))


if __name__ == "__main__":
    main()
