"""An OpenAI-compatible chat server over a transformers model and the engine (models/engine.py),
for machines without llama.cpp (a GPU machine): the user simulator, the analyst, a reviewer.

Concurrent requests decode together (the engine's batcher), a conversation's earlier turns and a
shared system prompt stay in its cache. Tool calls are parsed from the text, as for llama.cpp
with the model's own template. `response_format` is enforced as llama.cpp does it: the reply is
decoded to the JSON schema (models/grammar.py, xgrammar). Where xgrammar is not installed the reply
is only started with the schema's first key (schema_prefix), and callers validate and retry, as with
any endpoint.

    python -m trace_rl.models.engine_server --model qwen2.5-coder-1.5b --port 8081 [--rows 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trace_rl.models import grammar
from trace_rl.models.chat import parse_tool_calls
from trace_rl.models.endpoints import ServerProcess, exit_with_parent
from trace_rl.models.hf_policy import HFPolicy, encode, render


def schema_prefix(response_format: dict | None) -> str:
    """The opening of the JSON object that `response_format`'s schema asks for (`{"capabilities": `).
    For an engine without xgrammar: written into the assistant's turn, this opening holds a small model to
    the asked shape (without it, it may answer an analyst prompt with a tool call of its own). Not a
    guarantee: the client still validates and retries. Both forms: OpenAI's json_schema, and
    llama.cpp's json_object + schema."""
    schema = grammar.request_schema(response_format) or {}
    props = list(schema.get("properties") or {})
    if not props:
        return ""
    required = schema.get("required") or []
    return '{"' + next((p for p in props if p in required), props[0]) + '": '


def make_handler(policy, name: str):
    """The request handler for one model (`policy`: an HFPolicy, whose engine batches requests)."""
    from trace_rl.models.engine import Request

    tok = policy.tokenizer
    engine = policy.batcher.engine
    stops = engine.stop_set
    grammars = None
    if grammar.available():
        try:
            grammars = grammar.Grammars(tok, engine.vocab_size, sorted(stops))
        except Exception as err:  # a tokenizer xgrammar cannot read: structured replies fall back to the prefix
            print(f"serve: no grammar for this tokenizer ({type(err).__name__}: {err}); response_format is "
                  "not enforced", file=sys.stderr, flush=True)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: one line per request is noise at thousands of requests
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models"):
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # read, whatever the route
            if not self.path.rstrip("/").endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                req = json.loads(body or b"{}")
                messages, tools = req["messages"], req.get("tools") or None
                schema = None if tools else grammar.request_schema(req.get("response_format"))
                matcher = grammars.matcher(schema) if schema and grammars else None
                prefix = "" if tools or matcher else schema_prefix(req.get("response_format"))
                ids = encode(tok, render(tok, messages, tools, add_generation_prompt=True) + prefix)
                max_new = int(req.get("max_tokens") or req.get("max_completion_tokens") or 512)
                temp = float(req.get("temperature") if req.get("temperature") is not None else 0.0)
                if max_new < 1 or not ids or temp < 0:
                    raise ValueError("max_tokens must be >= 1, temperature >= 0, and the prompt not empty")
            except Exception as err:  # malformed JSON, messages the template cannot render, bad numbers
                return self._send(400, {"error": {"message": f"bad request: {type(err).__name__}: {err}",
                                                  "type": "invalid_request_error"}})
            if len(ids) + max_new > engine.limit:
                return self._send(400, {"error": {
                    "message": f"This model's maximum context length is {engine.limit} tokens; the request needs "
                               f"{len(ids) + max_new}", "code": "context_length_exceeded",
                    "type": "invalid_request_error"}})
            t0 = time.perf_counter()
            try:
                new = policy.batcher.submit(Request(ids, max_new, temp, grammar=matcher))
            except Exception as err:  # the engine failed: the client sees a 500, the server lives on
                return self._send(500, {"error": {"message": f"{type(err).__name__}: {err}"}})
            text = prefix + tok.decode(new, skip_special_tokens=True).strip()
            calls = parse_tool_calls(text, {t["function"]["name"] for t in tools}) if tools else []
            stopped = bool(new) and new[-1] in stops
            message = {"role": "assistant", "content": None if calls else text}
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": name, "choices": [{"index": 0, "message": message,
                                            "finish_reason": "tool_calls" if calls else "stop" if stopped else "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new),
                          "total_tokens": len(ids) + len(new)},
                "timings": {"seconds": time.perf_counter() - t0}})

    return Handler


class Server(ThreadingHTTPServer):
    """A batch of rows connects at once; http.server's listen backlog of 5 drops the SYNs of a burst past it while
    the accept loop is busy, and each dropped one retries only after a second."""
    request_queue_size = 1024
    daemon_threads = True


def serve(model: str, host: str = "127.0.0.1", port: int = 8081, rows: int | None = None,
          max_len: int = 16384, decode: str = "auto") -> None:
    """Load `model` (embedded name, .gguf, or transformers folder) and serve it until killed."""
    policy = HFPolicy.load(model, rows=rows, max_len=max_len, decode=decode)
    name = Path(model).stem
    server = Server((host, port), make_handler(policy, name))
    print(f"serving {name} on http://{host}:{port}/v1 (engine rows={policy.batcher.engine.rows})", flush=True)
    server.serve_forever()


@dataclass
class HFServer(ServerProcess):
    """`serve` in a child process that ends with this one (see models/endpoints.py)."""
    rows: int | None = None
    max_len: int = 16384
    decode: str = "auto"
    startup_timeout: float = 900.0  # a first start converts the GGUF for transformers

    def command(self) -> list[str]:
        return [sys.executable, "-m", "trace_rl.models.engine_server", "--parent", str(os.getpid()), "--model", self.model,
                "--host", self.host, "--port", str(self.port), "--max-len", str(self.max_len), "--decode", self.decode] + \
            (["--rows", str(self.rows)] if self.rows else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8081)
    ap.add_argument("--rows", type=int, default=None, help="conversations decoded together (default 16 on CUDA)")
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--decode", default="auto", help="the engine's decode step: auto, eager, graph or inductor")
    ap.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    args = ap.parse_args()
    if args.parent:
        exit_with_parent(args.parent)
    serve(args.model, args.host, args.port, args.rows, args.max_len, args.decode)


if __name__ == "__main__":
    main()
