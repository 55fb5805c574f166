"""The one LLM client every agent uses: OpenAI-compatible chat with accounting.

`LLMConfig.model` is the single field that picks the model: an embedded model name
or a .gguf path (served locally by llama.cpp on first use), or, with `base_url` set,
the model name at any OpenAI-compatible endpoint (vLLM, llama.cpp, a provider).
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import suppress
from typing import Annotated, Any, Callable, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from trace_rl.core.episode import tool_arguments
from trace_rl.models.chat import (Reply, RequestDeadlineError, StructuredOutputError, ToolCall, Usage, extract_json,
                                  is_response_format_rejected, parse_tool_calls)
from trace_rl.models.endpoints import ENDPOINTS

T = TypeVar("T", bound=BaseModel)


def endpoint_list(value):
    """A base_url given as a list (a fleet of servers behind no balancer) as the one string the config keeps:
    the URLs comma-separated, in order (LLM sends requests to them in turn)."""
    return ",".join(str(u).strip() for u in value) if isinstance(value, (list, tuple)) else value


Endpoints = Annotated[str | None, BeforeValidator(endpoint_list)]  # a base_url field: a list arrives as one string


class LLMConfig(BaseModel):
    """One model at one endpoint: every model the pipeline calls is configured with this."""
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored

    model: str = Field("qwen2.5-coder-0.5b", description="embedded model name, path to a .gguf, or remote model name")
    base_url: Endpoints = Field(None, description="OpenAI-compatible endpoint; several serving the same model "
                                 "(comma-separated, or a list) take requests in turn; unset = serve `model` locally")
    api_key: str | None = Field(None, exclude=True, description="defaults to $OPENAI_API_KEY, or a dummy for local "
                                                                 "servers; never written to a run directory")
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(512, ge=16)
    timeout: float | None = Field(None, gt=0, description="seconds an endpoint may stay silent (connect, each "
                                  "read); unset: 3600 for a local CPU server (a long answer on a CPU can take minutes), "
                                  "600 remote")
    deadline: float | None = Field(None, gt=0, description="seconds one request may take in all (the client's "
                                   "own retries included), however slowly the endpoint drips its answer; unset: "
                                   "the timeout")
    retries: int = 2
    n_ctx: int = 16384  # tau2 telecom's solo prompt + tools is ~11k tokens
    price_in_per_mtok: float = 0.0
    price_out_per_mtok: float = 0.0
    constrained_json: bool = Field(True, description="structured(): ask the endpoint to decode to the JSON schema "
                                                     "(llama.cpp grammar, vLLM/OpenAI json_schema)")
    lora: str | None = Field(None, description="a peft LoRA adapter folder trained on `model`, applied by the local "
                                               "llama.cpp server (converted to a GGUF LoRA once)")
    flash_attn: bool = Field(False, description="flash attention on the local llama.cpp server: long prompts read "
                                                "faster on a CPU, but a greedy reply then depends on how its prompt "
                                                "was split between cached and new tokens")

    @model_validator(mode="after")
    def _lora_is_local(self):
        if self.lora and self.base_url:
            raise ValueError(f"lora: {self.lora!r} is applied by the local llama.cpp server; the endpoint "
                             f"{self.base_url} must load it itself: unset base_url or lora")
        return self


# ---------------------------------------------------------------- local endpoints (one registry: models/endpoints.py)
RESULT_FIELDS = ("model", "base_url", "temperature", "max_tokens", "lora", "flash_attn")  # what changes an answer


def result_settings(llm: LLMConfig) -> dict:
    """The fields of `llm` that change what it answers (not timeouts, retries, prices, nor how it is served),
    with its weights' hash where that is cheap (models/weights.py model_hash)."""
    from trace_rl.models.weights import model_hash

    return {**{f: getattr(llm, f) for f in RESULT_FIELDS}, "model_sha256": model_hash(llm.model)}


def local_endpoint(model: str, n_ctx: int = 16384, instance: str = "agent", lora: str | None = None,
                   flash_attn: bool = False) -> tuple[str, str]:
    """(base_url, served name) for a local model, starting one llama.cpp server per (model,
    instance). An agent and its user simulator get separate instances: llama.cpp keeps one
    prompt prefix per server, and two alternating conversations on one server would re-read
    the whole prompt on every call (llama-cpp-python's multi-state RAM cache copies the full
    logits with each state, ~3 GB per 5k-token prompt with Qwen's vocabulary: not usable).
    `lora`: a peft adapter folder; its server applies it as a GGUF LoRA."""
    def make():
        from trace_rl.models.llama_server import LlamaServer
        from trace_rl.models.lora_gguf import gguf_lora
        from trace_rl.models.weights import gguf_path

        return LlamaServer(model, n_ctx=n_ctx, lora=gguf_lora(lora, gguf_path(model)) if lora else None,
                           flash_attn=flash_attn)
    srv = ENDPOINTS.get(("llama.cpp", model, n_ctx, instance, lora, flash_attn), make)
    return srv.base_url, srv.model_name


def served(llm: LLMConfig, serve: str, rows: int = 64, decode: str = "auto", *, lora_capable: bool = False,
           weights: str | None = None, gpu_memory: float = 0.4) -> LLMConfig:
    """An LLMConfig as the run reaches it: unchanged with a base_url or under llama.cpp (served on
    first use by `local_endpoint`); under serve=hf, pointed at one engine server per model (started once;
    `decode`: its engine's decode step, models/engine.py); under serve=vllm, at one vLLM server per model
    (models/vllm_server.py), an adapter (`lora`) being a LoRA request to it: the config then names the
    adapter as its model. vLLM's options: `lora_capable` starts that model's server with LoRA (the run's base
    model, whose adapters it will serve), `weights` the folder it loads (default: the model's transformers
    checkpoint), `gpu_memory` its share of the GPU."""
    if serve == "vllm" and not llm.base_url:
        return vllm_served(llm, rows, lora_capable=lora_capable, weights=weights, gpu_memory=gpu_memory)
    if serve != "hf" or llm.base_url:
        return llm
    if llm.lora:
        raise ValueError(f"lora: {llm.lora!r} is applied by llama.cpp or vLLM; the engine server (serve=hf) serves "
                         "base models only: use serve=llama.cpp or serve=vllm, or evaluate the adapter in-process")

    def make():
        from trace_rl.models.engine_server import HFServer

        return HFServer(llm.model, rows=rows, max_len=llm.n_ctx, decode=decode)
    return llm.model_copy(update={"base_url": ENDPOINTS.get(("hf", llm.model), make).base_url})


def vllm_served(llm: LLMConfig, rows: int = 64, *, lora_capable: bool = False, weights: str | None = None,
                gpu_memory: float = 0.4) -> LLMConfig:
    """serve=vllm: `llm` pointed at the vLLM server of its model (started once, by the first caller: with
    LoRA if that caller or `llm` needs it); an adapter is loaded into it and named as the model."""
    from trace_rl.models.vllm_server import VllmServer, require_vllm

    require_vllm()

    def make():
        from trace_rl.models.weights import hf_checkpoint

        return VllmServer(str(hf_checkpoint(weights or llm.model)), served_name=llm.model, max_model_len=llm.n_ctx,
                          max_num_seqs=rows, gpu_memory_utilization=gpu_memory,
                          enable_lora=lora_capable or bool(llm.lora))
    srv = ENDPOINTS.get(("vllm", llm.model), make)
    update = {"base_url": srv.base_url, "lora": None}
    if llm.lora:
        update["model"] = srv.adapter(llm.lora)
    return llm.model_copy(update=update)


def stop_lora_endpoints() -> int:
    """Stop the local servers that apply a LoRA (an evaluation's adapter rows, one server each): otherwise each
    holds its model and context until the process ends, and the autonomous loop makes new ones every iteration.
    A later request for one starts it again. Returns how many were stopped."""
    return ENDPOINTS.stop(lambda key: key[0] == "llama.cpp" and bool(key[4]))


class LLM:
    """Chat completions with retries, timeouts, usage/cost accounting and tool-call parsing."""

    def __init__(self, config: LLMConfig | None = None, **overrides):
        self.config = (config or LLMConfig()).model_copy(update=overrides)
        self.usage = Usage()
        self._lock = threading.Lock()
        self._clients: list | None = None  # one per endpoint of base_url
        self._turn = 0
        self._served_name: str | None = None

    def __getstate__(self) -> dict:
        """Shipped to another process (executor=ray): its clients and lock are made there anew."""
        return {**self.__dict__, "_lock": None, "_clients": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def name(self) -> str:
        return f"{self.config.model}+{self.config.lora}" if self.config.lora else self.config.model

    @property
    def backend(self) -> str:
        """What produces this model's answers: llama.cpp, vllm, engine (this project's, serve=hf) or endpoint
        (a base_url this process did not start); an evaluation row records it."""
        if not self.config.base_url:
            return "llama.cpp"
        kind = ENDPOINTS.kind_of(self.config.base_url)
        return {"hf": "engine"}.get(kind, kind) if kind else "endpoint"

    def _openai(self):
        """The client of the endpoint whose turn it is: base_url may name several serving the same model
        (comma-separated), which then take the requests in turn (round robin)."""
        clients = self._clients
        if clients is None:
            from openai import OpenAI

            local = self.config.base_url is None
            if local:
                url, self._served_name = local_endpoint(self.config.model, self.config.n_ctx, lora=self.config.lora,
                                                        flash_attn=self.config.flash_attn)
                urls = [url]
            else:
                urls, self._served_name = [u.strip() for u in self.config.base_url.split(",") if u.strip()], \
                    self.config.model
            key = self.config.api_key or os.environ.get("OPENAI_API_KEY") or "sk-local"
            timeout = self.config.timeout or (3600.0 if local else 600.0)
            # a local server keeps working on a request whose client gave up: a retry would queue behind it
            self._clients = clients = [OpenAI(base_url=url, api_key=key, timeout=timeout,
                                              max_retries=0 if local else self.config.retries) for url in urls]
        with self._lock:
            self._turn += 1
            return clients[(self._turn - 1) % len(clients)]

    def _within_deadline(self, request: Callable[[], Any], client=None) -> Any:
        """`request()` (a call on `client`) in a thread, waited for at most the deadline: a server that sends a
        byte every few seconds never trips the read timeout. Past the deadline the client is closed (which
        breaks the stuck socket and ends the thread) and fresh ones serve the next request."""
        client = self._openai() if client is None else client
        timeout = client.timeout  # the float given to the client, or an httpx.Timeout
        deadline = self.config.deadline or getattr(timeout, "read", timeout) or 600.0
        box: dict = {}

        def run():
            try:
                box["value"] = request()
            except BaseException as err:
                box["error"] = err
        worker = threading.Thread(target=run, name="llm-request", daemon=True)
        worker.start()
        worker.join(deadline)
        if worker.is_alive():
            with self._lock:
                self._clients = None
            with suppress(Exception):
                client.close()
            raise RequestDeadlineError(f"{self.name}: no complete answer within the {deadline:g} s deadline "
                                       f"(deadline: in the model's config)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _complete(self, messages: list[dict], tools: list[dict] | None, **kw) -> Reply:
        """One request to the endpoint. Test doubles override this method only."""
        client = self._openai()
        args: dict[str, Any] = {"model": self._served_name, "messages": messages,
                                "temperature": kw.get("temperature", self.config.temperature),
                                "max_tokens": kw.get("max_tokens", self.config.max_tokens)}
        if tools:
            args["tools"] = tools
            if kw.get("tool_choice"):
                args["tool_choice"] = kw["tool_choice"]
        if kw.get("response_format"):
            args["response_format"] = kw["response_format"]
        if kw.get("seed") is not None:
            args["seed"] = kw["seed"]
        t0 = time.perf_counter()
        resp = self._within_deadline(lambda: client.chat.completions.create(**args), client)
        dt = time.perf_counter() - t0
        choice = resp.choices[0]
        calls = []
        for tc in choice.message.tool_calls or []:
            arguments = tool_arguments(tc.function.arguments)
            calls.append(ToolCall(name=tc.function.name, id=tc.id or ToolCall("", {}).id,
                                  arguments={"__malformed__": tc.function.arguments} if arguments is None else arguments))
        usage = resp.usage
        return Reply(content=choice.message.content or "", tool_calls=calls,
                     prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                     completion_tokens=getattr(usage, "completion_tokens", 0) or 0, seconds=dt)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, text_tool_calls: bool = True,
             **kw) -> Reply:
        """One reply; with `text_tool_calls`, calls a small model wrote as text (JSON in the body) are
        recovered into `tool_calls` and marked so."""
        reply = self._complete(messages, tools, **kw)
        if tools and text_tool_calls and not reply.tool_calls:
            names = {t["function"]["name"] for t in tools}
            if calls := parse_tool_calls(reply.content, names):
                reply.tool_calls, reply.tool_calls_from_text = calls, True
        cost = (reply.prompt_tokens * self.config.price_in_per_mtok
                + reply.completion_tokens * self.config.price_out_per_mtok) / 1e6
        with self._lock:
            self.usage.add(reply, cost)
        return reply

    def response_format(self, schema: type[BaseModel] | dict) -> dict:
        """Schema-constrained decoding in the dialect of the endpoint: llama-cpp-python's server
        (ours, when no base_url is set) takes json_object + schema; OpenAI-style ones json_schema.
        `schema`: a pydantic model, or a JSON schema as a dict."""
        js = schema if isinstance(schema, dict) else schema.model_json_schema()
        if self.config.base_url is None:
            return {"type": "json_object", "schema": js}
        name = js.get("title", "answer") if isinstance(schema, dict) else schema.__name__
        return {"type": "json_schema", "json_schema": {"name": name, "schema": js}}

    def ask(self, messages: list[dict], parse: Callable[[str], T], attempts: int = 3,
            again: str = "Reply again with the whole corrected answer.", **kw) -> T:
        """The one ask -> validate -> retry loop: `parse(answer)` gives the result or raises
        ValueError; the model then sees the error and answers again, up to `attempts` times."""
        msgs, last, text = list(messages), "", ""
        for _ in range(attempts):
            try:
                text = self.chat(msgs, **kw).content
            except Exception as err:  # an endpoint that rejects response_format: plain prompting instead
                if "response_format" not in kw or not is_response_format_rejected(err):
                    raise
                kw.pop("response_format")
                text = self.chat(msgs, **kw).content
            try:
                return parse(text)
            except ValueError as err:  # pydantic's ValidationError is one
                last = str(err)
                msgs += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"That answer was not valid:\n{last[:1500]}\n{again}"}]
        raise StructuredOutputError(f"no valid answer after {attempts} attempts; last error: {last[:1500]}", reply=text)

    def structured(self, messages: list[dict], schema: type[T], attempts: int = 3,
                   check: Callable[[Any], Any] | None = None, decode_schema: dict | None = None, **kw):
        """JSON matching `schema` (decoding constrained to it, or to the tighter `decode_schema`, where
        the endpoint can), then `check(value)` for what a grammar cannot express (names, sentence
        counts, ids): its ValueError goes back to the model like a parse error; its return value is
        the answer."""
        if self.config.constrained_json and "response_format" not in kw:
            kw["response_format"] = self.response_format(decode_schema or schema)

        def parse(text: str):
            value = schema.model_validate(extract_json(text))
            return check(value) if check else value
        try:
            return self.ask(messages, parse, attempts, "Reply again with only the corrected JSON.", **kw)
        except StructuredOutputError as err:
            raise StructuredOutputError(f"{schema.__name__}: {err}", reply=err.reply) from None
