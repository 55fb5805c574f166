"""Where one decode step's GPU time goes: kernels per step, their summed time, and the top kernels,
for the engine's `graph` and `inductor` modes (random init of a Qwen2.5 shape, bf16, 128-token prompt).

    python benchmarks/decode_profile.py [--variant base|moe] [--batch 1] [--modes graph,inductor]
    (CUDA only; run from benchmarks/ or with it on PYTHONPATH)

The step is run outside its CUDA graph under the profiler (kernel times are the same; the launch
gaps are not), then its captured graph is replayed on its own for the step's real wall time.
"""
import argparse
import time

import torch
from moe_throughput import Tok, models
from torch.profiler import ProfilerActivity, profile

from trace_rl.models.engine import Engine, Request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1.5b")
    ap.add_argument("--variant", default="base", choices=["base", "lora", "moe"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="graph,inductor")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    net = models(args.config, torch.device("cuda"), [args.variant])[args.variant]
    for mode in args.modes.split(","):
        eng = Engine(net, Tok(), rows=args.batch, max_len=272, compile=mode,
                     before_forward=net.route_rows if hasattr(net, "gates") else None)
        with torch.no_grad():
            eng.generate([Request(list(range(1000 + i, 1128 + i)), 32, 0.0, tag=-1) for i in range(args.batch)])
            step, graph = eng._compiled[False], eng._graph[False]  # compiled and captured by now
            for run, what in ((step, "no-graph step"), (graph.replay, "graph replay")):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    run()
                torch.cuda.synchronize()
                print(f"{args.variant} batch {args.batch} {mode} {what} ms {(time.perf_counter() - t0) / 50 * 1e3:.3f}")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"{mode} kernels/step {len(kernels) / args.steps:.0f}, "
              f"kernel time/step {sum(e.device_time for e in kernels) / args.steps / 1e3:.3f} ms")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=16, max_name_column_width=70))


if __name__ == "__main__":
    main()
