"""The OpenAI-compatible server over the engine: the project's own client talks to it like to
llama.cpp; concurrent requests are decoded together; an over-long request is a typed 400."""
import threading
from http.server import ThreadingHTTPServer

import pytest

from tiny import tiny_model, tiny_tokenizer
from trace_rl.models.chat import is_context_length_error
from trace_rl.models.llm import LLM, LLMConfig
from trace_rl.models.endpoints import free_port
from trace_rl.models.hf_policy import HFPolicy
from trace_rl.models.engine_server import make_handler


@pytest.fixture(scope="module")
def server():
    tok = tiny_tokenizer()
    policy = HFPolicy(tiny_model(tok, seed=1), tok, "tiny", rows=4, max_len=512)
    port = free_port()
    httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(policy, "tiny"))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}/v1", policy
    httpd.shutdown()


def test_the_client_gets_the_same_answer_as_the_policy_in_process(server):
    url, policy = server
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Paris"}]
    llm = LLM(LLMConfig(model="tiny", base_url=url, max_tokens=16))
    reply = llm.chat(msgs)
    fresh = HFPolicy(policy.model, policy.tokenizer, "tiny", max_new_tokens=16).chat(msgs)
    assert reply.content == fresh.content and reply.completion_tokens == fresh.completion_tokens > 0
    assert reply.prompt_tokens == fresh.prompt_tokens


def test_concurrent_requests_are_decoded_together(server):
    url, policy = server
    engine = policy.batcher.engine
    calls = []
    real = engine.generate
    engine.generate = lambda reqs: calls.append(len(reqs)) or real(reqs)
    llm = LLM(LLMConfig(model="tiny", base_url=url, max_tokens=16))
    out = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, llm.chat(
        [{"role": "user", "content": f"say {i} a b"}]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.generate = real
    assert all(o is not None for o in out) and max(calls) >= 2  # at least two requests shared a batch


def test_a_request_beyond_the_model_is_a_context_length_error(server):
    url, _ = server
    llm = LLM(LLMConfig(model="tiny", base_url=url, max_tokens=16, retries=0))
    with pytest.raises(Exception) as err:
        llm.chat([{"role": "user", "content": "a b c " * 3000}])
    assert is_context_length_error(err.value)


def test_the_server_runs_as_a_child_process_and_stops(tmp_path):
    from tiny import save_tiny
    from trace_rl.models.engine_server import HFServer

    path = save_tiny(tmp_path / "tiny")
    with HFServer(str(path), rows=2, max_len=512) as srv:
        reply = LLM(LLMConfig(model="tiny", base_url=srv.base_url, max_tokens=16)).chat([{"role": "user", "content": "a"}])
        assert reply.completion_tokens > 0
        proc = srv.proc
    assert proc.poll() is not None  # gone with the context


def test_schema_prefix_opens_the_asked_object_in_both_request_forms():
    from pydantic import BaseModel

    from trace_rl.models.engine_server import schema_prefix

    class Candidates(BaseModel):
        capabilities: list[str]
        note: str = ""

    llm = LLM(LLMConfig(model="tiny", base_url="http://x/v1"))
    openai_form = llm.response_format(Candidates)
    llama_form = {"type": "json_object", "schema": Candidates.model_json_schema()}
    assert schema_prefix(openai_form) == schema_prefix(llama_form) == '{"capabilities": '
    assert schema_prefix({"type": "json_schema", "json_schema": {"schema": {
        "properties": {"a": {}, "b": {}}, "required": ["b"]}}}) == '{"b": '  # a required key first
    assert schema_prefix(None) == schema_prefix({"type": "json_object"}) == ""


def test_a_structured_request_is_decoded_to_its_schema(server):
    """The engine's grammar (xgrammar) holds the tiny random model to the schema, as llama.cpp's does."""
    import json

    url, _ = server
    llm = LLM(LLMConfig(model="tiny", base_url=url, max_tokens=64))
    msgs = [{"role": "user", "content": "name one capability"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "C", "schema": {
        "type": "object", "required": ["capabilities"], "additionalProperties": False,
        "properties": {"capabilities": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}}}
    reply = json.loads(llm.chat(msgs, response_format=fmt).content)
    assert list(reply) == ["capabilities"] and set(reply["capabilities"]) <= {"a", "b"}
    plain = llm.chat(msgs).content or ""
    with pytest.raises(ValueError):
        json.loads(plain)


def test_without_xgrammar_a_structured_reply_is_started_with_the_schema_prefix(server, monkeypatch):
    from trace_rl.models import grammar

    _, policy = server
    monkeypatch.setattr(grammar, "available", lambda: False)
    port = free_port()
    httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(policy, "tiny"))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        llm = LLM(LLMConfig(model="tiny", base_url=f"http://127.0.0.1:{port}/v1", max_tokens=16))
        msgs = [{"role": "user", "content": "name one capability"}]
        fmt = {"type": "json_schema", "json_schema": {"name": "C", "schema": {
            "properties": {"capabilities": {"type": "array"}}, "required": ["capabilities"]}}}
        assert llm.chat(msgs, response_format=fmt).content.startswith('{"capabilities": ')
        assert not (llm.chat(msgs).content or "").startswith('{"capabilities": ')
    finally:
        httpd.shutdown()


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_response_format(server):
    import openai

    url, _ = server
    llm = LLM(LLMConfig(model="tiny", base_url=url, max_tokens=16, retries=0))
    fmt = {"type": "json_schema", "json_schema": {"name": "C", "schema": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        llm.chat([{"role": "user", "content": "a"}], response_format=fmt)
