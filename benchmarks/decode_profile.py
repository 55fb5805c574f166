"""Where one decode step's GPU time goes: kernels per step, their summed time, and the top kernels,
for the engine's `graph` and `inductor` modes (base model, batch 1, random init of a Qwen2.5 shape).

    python benchmarks/decode_profile.py            (CUDA only; run from benchmarks/ or with it on PYTHONPATH)

The step is run outside its CUDA graph under the profiler (kernel times are the same; the launch
gaps are not), then its captured graph is replayed on its own for the step's real wall time.
"""
import time

import torch
from moe_throughput import CONFIGS, Tok
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

from trace_rl.training.engine import Engine, Request


def main(config: str = "1.5b", steps: int = 10):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[config], max_position_embeddings=4096)).to(dev, torch.bfloat16).eval()
    for mode in ["graph", "inductor"]:
        eng = Engine(base, Tok(), rows=1, max_len=272, compile=mode)
        with torch.no_grad():
            eng.generate([Request(list(range(1000, 1128)), 32, 0.0, tag=-1)])  # compiles and captures
            step, graph = eng._compiled[False], eng._graph[False]
            for run, what in ((step, "no-graph step"), (graph.replay, "graph replay")):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    run()
                torch.cuda.synchronize()
                print(f"{mode} {what} ms {(time.perf_counter() - t0) / 50 * 1e3:.3f}")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"{mode} kernels/step {len(kernels) / steps:.0f}, "
              f"kernel time/step {sum(e.device_time for e in kernels) / steps / 1e3:.3f} ms")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
