"""A tiny OpenAI-shaped HTTP server for tests of client-side logic (what a request says, how replies are
counted): chat/completions, completions (with vLLM's `return_token_ids`), vLLM's load/unload_lora_adapter.
It records every request. Not a model: each reply is `tokens` tokens of "x"."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

from trace_rl.models.engine_server import Server


class FakeOpenAI:
    def __init__(self, tokens: int = 8, delay: float = 0.0, models: tuple[str, ...] = ("m",)):
        self.tokens, self.delay, self.models = tokens, delay, list(models)
        self.requests: list[tuple[str, dict]] = []
        self.loras: dict[str, str] = {}
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, body) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    return self._send(200, {"object": "list", "data": [{"id": m} for m in fake.models + list(fake.loras)]})
                self._send(404, {"error": {"message": self.path}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                route = self.path.rstrip("/").rsplit("/", 1)[-1]
                with fake._lock:
                    fake.requests.append((route, body))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if fake.delay:
                        time.sleep(fake.delay)
                    self._route(route, body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

            def _route(self, route: str, body: dict):
                if route == "load_lora_adapter":
                    if body["lora_name"] in fake.loras:
                        return self._send(400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has "
                                                                     "already been loaded."}})
                    fake.loras[body["lora_name"]] = body["lora_path"]
                    return self._send(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
                if route == "unload_lora_adapter":
                    if fake.loras.pop(body["lora_name"], None) is None:
                        return self._send(404, {"error": {"message": "not found"}})
                    return self._send(200, "Success")
                model = body.get("model")
                if model not in fake.models and model not in fake.loras:
                    return self._send(404, {"error": {"message": f"The model `{model}` does not exist."}})
                n = min(fake.tokens, int(body.get("max_tokens") or fake.tokens))
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                if self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(200, {"id": "c", "object": "chat.completion", "model": model, "usage": usage,
                                            "choices": [{"index": 0, "finish_reason": "length",
                                                         "message": {"role": "assistant", "content": "x" * n}}]})
                prompts = body["prompt"] if isinstance(body["prompt"], list) and body["prompt"] and \
                    isinstance(body["prompt"][0], list) else [body["prompt"]]
                choices = [{"index": i, "text": "x" * n, "finish_reason": "length",
                            **({"token_ids": [7] * n} if body.get("return_token_ids") else {})}
                           for i, _ in enumerate(prompts)]
                return self._send(200, {"id": "c", "object": "text_completion", "model": model, "choices": choices,
                                        "usage": {**usage, "completion_tokens": n * len(prompts)}})

        self.server = Server(("127.0.0.1", 0), Handler)  # the engine server's backlog: a burst is accepted at once
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def routes(self, route: str) -> list[dict]:
        return [b for r, b in self.requests if r == route]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
