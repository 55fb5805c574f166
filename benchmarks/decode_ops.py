"""Operations per decode step, counted on any device (CPU included): what a launch-bound GPU step
pays for. Without `--compiled`: the aten operations of one one-token forward that compute something
(views and reshapes excluded), one kernel each in eager or CUDA-graph mode. With `--compiled`: the
launches in the code inductor generates for the engine's decode step (fused kernels, GEMMs and
fallbacks), on CUDA if there is one, else on the CPU (C++ kernels; GPU fusion may differ). Both
count the base model and the 4-expert MoE, and print the MoE's extra operations per layer.

    python benchmarks/decode_ops.py [--config tiny|0.5b|1.5b] [--compiled [--save-code DIR]] [--layers N]
    (run from benchmarks/ or with it on PYTHONPATH)
"""
import argparse
import collections
import re
from pathlib import Path

import torch
from moe_throughput import CONFIGS, Tok, models
from torch.utils._python_dispatch import TorchDispatchMode

from trace_rl.models.fuse import fuse_projections

VIEWS = ("view", "slice", "unsqueeze", "aten.t.", "transpose", "permute", "split", "expand", "squeeze", "alias",
         "_unsafe_view", "lift_fresh", "detach", "unflatten", "flatten")
# a launch in inductor's `call`: a Triton kernel's .run(, a C++ kernel's call, a GEMM, an aten fallback
LAUNCH = re.compile(r"^\s+(?:(\w+)\.run\(|(cpp_fused\w+)\(|extern_kernels\.(\w+)\(|(?:torch\.ops\.)?(aten\.\w+)[.(])",
                    re.M)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(v in str(func) for v in VIEWS):
            self.ops[str(func).removeprefix("aten.").removesuffix(".default")] += 1
        return func(*args, **(kwargs or {}))


def eager_ops(name: str, net) -> collections.Counter:
    """aten operations of one one-token forward, projections stacked as the engine's compiled steps run them."""
    fuse_projections(net.model if name == "moe" else net)
    dev = next(net.parameters()).device
    with torch.no_grad(), CountOps() as c:
        if name == "moe":
            net.route_rows(torch.tensor([-1], device=dev))  # the engine's per-row routing, once per step
        net(input_ids=torch.tensor([[5]], device=dev))
    return c.ops


def compiled_launches(name: str, net, save: str | None = None) -> collections.Counter:
    """Launches in the inductor code of the engine's decode step (prefill stays eager); the code
    goes to `save`/<name>_<i>.py if given. Prints dynamo's graph breaks, with their reasons."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from trace_rl.models.engine import Engine, Request

    eng = Engine(net, Tok(), rows=1, max_len=64, compile="inductor",
                 before_forward=net.route_rows if name == "moe" else None)
    counters["graph_break"].clear()
    with torch.no_grad():
        _, codes = run_and_get_code(eng.generate, [Request(list(range(1000, 1016)), 4, 0.0, tag=-1)])
    for reason, n in counters["graph_break"].items():  # each break splits the step: more launches, less fusion
        print(f"{name}: graph break x{n}: {reason}")
    launches = collections.Counter()
    for i, code in enumerate(codes):
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            (Path(save) / f"{name}_{i}.py").write_text(code)
        body = re.split(r"def get_args\(|\nrunner = Runner", code.split("def call(", 1)[-1])[0]
        for m in LAUNCH.finditer(body):
            triton, cpp, gemm, aten = m.groups()
            launches["fused kernel" if triton or cpp else gemm or aten] += 1
    return launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--compiled", action="store_true", help="count inductor's launches instead of eager operations")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (fewer compile faster; counts are per layer)")
    ap.add_argument("--save-code", default=None, help="with --compiled: write inductor's code to this folder")
    args = ap.parse_args()
    if args.layers:
        CONFIGS[args.config] = {**CONFIGS[args.config], "num_hidden_layers": args.layers}
    dev = torch.device("cuda" if args.compiled and torch.cuda.is_available() else "cpu")
    nets = models(args.config, dev, ["base", "moe"])
    counts = {name: compiled_launches(name, nets[name], args.save_code) if args.compiled else eager_ops(name, nets[name])
              for name in ("base", "moe")}
    layers = nets["base"].config.num_hidden_layers
    what = f"launches of the compiled decode step ({dev.type})" if args.compiled else "aten ops, one decode token"
    base, moe = sum(counts["base"].values()), sum(counts["moe"].values())
    print(f"Qwen2.5-{args.config} shape, {layers} layers, {what}: base {base}, MoE {moe}, "
          f"{(moe - base) / layers:.1f} extra per layer")
    for name in ("base", "moe"):
        print(f"{name}:", ", ".join(f"{op} {n}" for op, n in counts[name].most_common()))
    extra = counts["moe"] - counts["base"]
    print("extra per layer:", ", ".join(f"{op} {n / layers:.2g}" for op, n in extra.most_common()) or "none")


if __name__ == "__main__":
    main()
