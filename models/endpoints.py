"""The servers this project starts, in one registry: an OpenAI-compatible server per model in a child
process that ends with this one (llama.cpp: models/llama_server.py; the engine's: models/engine_server.py;
vLLM's: models/vllm_server.py), started once per key, stopped together."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trace_rl.core.io import cache_dir


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

    def env(self) -> dict[str, str] | None:
        """The child's environment (None: this process's own)."""
        return None

    def start(self) -> "ServerProcess":
        self.port = self.port or free_port()
        cmd = self.command()
        self.log_path = log_path = cache_dir() / "logs" / f"{type(self).__name__}-{self.port}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env())
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


def exit_with_parent(parent: int) -> None:
    """End this process as soon as `parent` is gone (even if it was SIGKILLed): no orphan server."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class Endpoints:
    """The servers this process started, one per key (the model and what else makes a server different);
    each is stopped when the process ends, or earlier by `stop`."""

    def __init__(self):
        self._servers: dict[tuple, ServerProcess] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, make: Callable[[], ServerProcess]) -> ServerProcess:
        """The running server for `key`, or `make()`'s, started now."""
        with self._lock:
            if key not in self._servers:
                srv = self._servers[key] = make().start()
                atexit.register(srv.stop)
            return self._servers[key]

    def kind_of(self, base_url: str | None) -> str | None:
        """Which kind of server (a key's first item: "llama.cpp", "hf", "vllm") answers at `base_url`;
        None for an endpoint this process did not start."""
        with self._lock:
            return next((k[0] for k, srv in self._servers.items() if base_url and srv.base_url == base_url), None)

    def stop(self, which: Callable[[tuple], bool]) -> int:
        """Stop the servers whose key `which` accepts (a later `get` starts them again); how many."""
        with self._lock:
            keys = [k for k in self._servers if which(k)]
            for k in keys:
                self._servers.pop(k).stop()
        return len(keys)


ENDPOINTS = Endpoints()
