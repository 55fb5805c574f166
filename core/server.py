"""llama.cpp's OpenAI-compatible server for a local GGUF, started and stopped by us.

Used for rollouts on CPU (llama.cpp decodes several times faster than transformers
here) and as the default endpoint for every agent when no base_url is configured.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trace_rl.core.models import MODELS, cache_dir, gguf_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """An OpenAI-compatible server in a child process that exits with this one; a context manager.
    Subclasses say what to run (`command`) and under which name it answers (`model_name`)."""

    model: str  # embedded model name or path
    port: int = 0  # 0 picks a free port
    host: str = "127.0.0.1"
    startup_timeout: float = 180.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return Path(self.model).stem

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "ServerProcess":
        self.port = self.port or free_port()
        cmd = self.command()
        log_path = cache_dir() / "logs" / f"{type(self).__name__}-{self.port}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{type(self).__name__} for {self.model} exited with {self.proc.returncode}; "
                                   f"log: {log_path}\n{log_path.read_text()[-3000:]}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{type(self).__name__} for {self.model} not healthy after {self.startup_timeout}s; "
                           f"log: {log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class LlamaServer(ServerProcess):
    """llama.cpp's server for a local GGUF (through our entry point: it exits when we die)."""

    n_ctx: int = 8192
    n_threads: int = max(1, os.cpu_count() or 1)
    chat_format: str | None = None  # None: the embedded model's own, else the GGUF template

    @property
    def model_name(self) -> str:
        """The name the server answers to (the alias we pass)."""
        return Path(self.model).stem if self.model.endswith(".gguf") else self.model

    def command(self) -> list[str]:
        path = gguf_path(self.model)
        chat_format = self.chat_format or (MODELS[self.model].chat_format if self.model in MODELS else None)
        return [sys.executable, "-m", "trace_rl.core.server", str(os.getpid()), "--model", str(path), "--model_alias",
                self.model_name, "--host", self.host, "--port", str(self.port), "--n_ctx", str(self.n_ctx),
                "--n_threads", str(self.n_threads)] + (["--chat_format", chat_format] if chat_format else [])


def exit_with_parent(parent: int) -> None:
    """End this process as soon as `parent` is gone (even if it was SIGKILLed): no orphan server."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _serve_while_parent_lives() -> None:
    """`python -m trace_rl.core.server PARENT_PID <llama_cpp.server args>`: llama.cpp's server."""
    exit_with_parent(int(sys.argv.pop(1)))
    from llama_cpp.server.__main__ import main

    main()


if __name__ == "__main__":
    _serve_while_parent_lives()
