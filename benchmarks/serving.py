"""vLLM vs this project's engine for one model, side by side in one call on one GPU (issue #42).

For each backend: its start-up time (process start to answering), then output tok/s with B concurrent
chat requests (B = 1, 32, 256 by default; each request its own prompt, greedy, `--max-tokens` new tokens), for
the base and for one LoRA; then, on a real benchmark, episodes per minute with `--episodes` concurrent
episodes (`trace-rl eval --serve vllm|hf`, its report's wall time, which leaves the servers' start-up out).

- vLLM: `serve: vllm`'s own server (models/vllm_server.py), the LoRA a request naming the adapter.
- engine: its OpenAI server (serve=hf, models/engine_server.py) for the base; it serves no adapter, so the engine's
  LoRA figure is the in-process engine with the adapter unmerged (how the pipeline decodes such a row on the
  engine), fed by the same number of concurrent threads.
- vLLM is asked for `ignore_eos` (every request writes max_tokens); the engine stops at its end token, so each row
  also gives the mean tokens per request: compare tok/s where those are equal.

    python benchmarks/serving.py --model qwen2.5-coder-1.5b --lora PATH [--bench toolsandbox] \\
        [--out benchmarks/results/serving_h100.json]
    python benchmarks/serving.py --endpoint NAME=URL [--lora-model NAME] ...   (servers already running: no start-up)

GPU only for the real figures; the request fan-out, the table and the arguments run anywhere (tested on a CPU
against a fake OpenAI-shaped server: tests/training/test_serving_bench.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPT = ("Write a long, detailed story (at least 800 words) about request number {i}: a lighthouse keeper who "
          "collects the names of ships. Do not stop early.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="embedded model name or transformers folder")
    ap.add_argument("--backends", default="vllm,engine", help="comma-separated: vllm, engine")
    ap.add_argument("--batches", default="1,32,256", help="concurrent requests, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per batch; the best is kept")
    ap.add_argument("--lora", default=None, help="a peft adapter folder trained on --model (r <= 16)")
    ap.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                    help="measure a running OpenAI-compatible server instead of starting the backends (repeatable)")
    ap.add_argument("--lora-model", default=None, help="with --endpoint: the served name of the LoRA")
    ap.add_argument("--bench", default="toolsandbox", help="benchmark for episodes/min ('' skips it)")
    ap.add_argument("--episodes", type=int, default=64, help="concurrent episodes (and tasks) for episodes/min; 0 skips")
    ap.add_argument("--gpu-memory", type=float, default=0.85, help="vLLM's share of the GPU")
    ap.add_argument("--out", default=None, help="JSON of every figure (rewritten after each)")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.backends = [b for b in args.backends.split(",") if b]
    if bad := set(args.backends) - {"vllm", "engine"}:
        ap.error(f"--backends: unknown {sorted(bad)}")
    if bad := [e for e in args.endpoint if "=" not in e]:
        ap.error(f"--endpoint takes NAME=URL, got {bad[0]!r}")
    return args


def _chat(base_url: str, model: str, content: str, max_tokens: int, extra: dict, timeout: float = 1800) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}
    req = urllib.request.Request(f"{base_url.rstrip('/')}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk-local"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


def fan_out(call, batch: int) -> dict:
    """`call(i)` -> completion tokens, from `batch` threads released together; wall time of the slowest."""
    tokens, errors, go = [0] * batch, [], threading.Barrier(batch + 1)

    def one(i: int) -> None:
        go.wait()
        try:
            tokens[i] = call(i)
        except Exception as err:  # one failed request fails the row, with its reason
            errors.append(f"{type(err).__name__}: {err}")
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(batch)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {batch} requests failed; first: {errors[0]}")
    return {"B": batch, "seconds": dt, "tokens": sum(tokens), "tok_s": sum(tokens) / dt if dt else 0.0,
            "mean_tokens": sum(tokens) / batch}


def throughput(call, batches: list[int], rounds: int) -> list[dict]:
    """Best of `rounds` per batch size (the first round of a new shape also warms it)."""
    return [max((fan_out(call, b) for _ in range(rounds)), key=lambda r: r["tok_s"]) for b in batches]


def http_call(base_url: str, model: str, max_tokens: int, extra: dict | None = None):
    return lambda i: _chat(base_url, model, PROMPT.format(i=i), max_tokens, extra or {})


def engine_lora_call(model: str, adapter: str, max_tokens: int, rows: int):
    """The in-process engine with the adapter unmerged (HFPolicy, its batcher): what the pipeline runs for an
    adapter row on the engine. GPU side; never run on a CPU here."""
    from trace_rl.models.engine import Request
    from trace_rl.models.hf_policy import HFPolicy, encode, render

    policy = HFPolicy.load(model, adapter, rows=rows, max_new_tokens=max_tokens)
    tok = policy.tokenizer

    def call(i: int) -> int:
        ids = encode(tok, render(tok, [{"role": "user", "content": PROMPT.format(i=i)}], add_generation_prompt=True))
        return len(policy.batcher.submit(Request(ids, max_tokens, 0.0)))
    return call


def episodes_per_minute(serve: str, model: str, bench: str, episodes: int, log_dir: Path) -> dict:
    """`trace-rl eval --serve SERVE` on `episodes` tasks at once; episodes/min from its report's wall time."""
    out = Path(tempfile.mkdtemp(prefix=f"serving-{serve}-"))
    cmd = [sys.executable, "-m", "trace_rl.graph.cli", "eval", "--benchmark", bench, "--model", model,
           "--serve", serve, "--concurrency", str(episodes), "--tasks", str(episodes), "--out", str(out / "eval")]
    t0 = time.perf_counter()
    with open(log_dir / f"episodes-{serve}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    report = out / "eval" / "report.json"
    if rc or not report.is_file():
        return {"status": f"failed (exit {rc}); log {log_dir / f'episodes-{serve}.log'}", "command": cmd}
    rep = json.loads(report.read_text())
    n = sum(g["episodes"] for g in rep["groups"].values())
    wall = rep["wall_seconds"]
    return {"status": "ok", "episodes": n, "wall_s": wall, "per_min": 60 * n / wall, "with_startup_s":
            time.perf_counter() - t0, "pass@1": next(iter(rep["groups"].values()))["pass@1"]}


def start_backend(name: str, model: str, lora: str | None, rows: int, gpu_memory: float):
    """(server, start-up seconds): the backend's server for `model`, started and answering."""
    if name == "vllm":
        from trace_rl.models.vllm_server import VllmServer
        from trace_rl.models.weights import hf_checkpoint

        srv = VllmServer(str(hf_checkpoint(model)), served_name=model, max_num_seqs=rows, max_model_len=4096,
                         gpu_memory_utilization=gpu_memory, enable_lora=bool(lora))
    else:
        from trace_rl.models.engine_server import HFServer

        srv = HFServer(model, rows=rows, max_len=4096)
    t0 = time.perf_counter()
    srv.start()
    return srv, time.perf_counter() - t0


def render(results: dict) -> str:
    """The markdown table of `results` ({"backends": {name: {...}}}): one row per backend and LoRA, a column per
    batch size, then start-up and episodes/min."""
    batches = sorted({r["B"] for b in results["backends"].values() for rows in (b.get("base"), b.get("lora"))
                      for r in rows or []})
    head = ["backend", "adapter", *(f"tok/s B={b} (tokens/req)" for b in batches), "start-up s", "episodes/min"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for name, b in results["backends"].items():
        for kind in ("base", "lora"):
            rows = {r["B"]: r for r in b.get(kind) or []}
            if not rows and kind == "lora":
                if b.get("lora_note"):
                    lines.append(f"| {name} | lora | {b['lora_note']} |" + " |" * (len(head) - 3))
                continue
            cells = [f"{rows[x]['tok_s']:,.0f} ({rows[x]['mean_tokens']:.0f})" if x in rows else "–" for x in batches]
            start = b.get(f"startup_{kind}_s")
            eps = (b.get("episodes") or {}) if kind == "base" else {}
            lines.append("| " + " | ".join([name, kind, *cells, f"{start:.0f}" if start is not None else "–",
                                            f"{eps['per_min']:.1f}" if eps.get("per_min") else eps.get("status", "–")])
                         + " |")
    return "\n".join(lines)


def save(results: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results: dict = {"model": args.model, "max_tokens": args.max_tokens, "batches": args.batches, "backends": {}}
    logs = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="serving-logs-"))
    if args.endpoint:  # servers already running: throughput only
        for pair in args.endpoint:
            name, url = pair.split("=", 1)
            b = results["backends"][name] = {"base": throughput(http_call(url, args.model, args.max_tokens),
                                                                args.batches, args.rounds)}
            if args.lora_model:
                b["lora"] = throughput(http_call(url, args.lora_model, args.max_tokens), args.batches, args.rounds)
            save(results, args.out)
    for name in [] if args.endpoint else args.backends:
        b = results["backends"][name] = {}
        extra = {"ignore_eos": True} if name == "vllm" else {}
        # vLLM: one server with LoRA on serves both rows (a base request on it is what the pipeline sends too)
        b["lora_enabled"] = bool(args.lora) and name == "vllm"  # its start-up then includes LoRA's set-up
        srv, b["startup_base_s"] = start_backend(name, args.model, args.lora if name == "vllm" else None,
                                                 max(args.batches), args.gpu_memory)
        try:
            b["base"] = throughput(http_call(srv.base_url, args.model, args.max_tokens, extra), args.batches, args.rounds)
            save(results, args.out)
            if args.lora and name == "vllm":
                lora = srv.adapter(args.lora)
                b["lora"] = throughput(http_call(srv.base_url, lora, args.max_tokens, extra), args.batches, args.rounds)
        finally:
            srv.stop()
        if args.lora and name == "engine":
            t0 = time.perf_counter()
            call = engine_lora_call(args.model, args.lora, args.max_tokens, max(args.batches))
            b["startup_lora_s"] = time.perf_counter() - t0
            b["lora"] = throughput(call, args.batches, args.rounds)
            b["lora_note"] = "in-process engine, adapter unmerged (the engine server serves no adapter)"
        save(results, args.out)
        if args.bench and args.episodes:
            b["episodes"] = episodes_per_minute("vllm" if name == "vllm" else "hf", args.model, args.bench,
                                                args.episodes, logs)
            save(results, args.out)
    results["table"] = render(results)
    save(results, args.out)
    print(results["table"])
    return results


if __name__ == "__main__":
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    main()
