import openai
import pytest
from pydantic import BaseModel

from doubles import ScriptedLLM
from trace_rl.models.chat import StructuredOutputError, extract_json, parse_tool_calls

NAMES = {"get_user", "done"}


@pytest.mark.parametrize("text,expected", [
    ('{"name": "get_user", "arguments": {"id": 3}}', [("get_user", {"id": 3})]),
    ('Sure:\n```json\n{"name": "get_user", "arguments": {"id": "a"}}\n```', [("get_user", {"id": "a"})]),
    ('<tool_call>\n{"name": "done", "arguments": {}}\n</tool_call>', [("done", {})]),
    ('{"name": "get_user", "parameters": {"id": 1}}', [("get_user", {"id": 1})]),
    ('{"function": {"name": "get_user", "arguments": "{\\"id\\": 2}"}}', [("get_user", {"id": 2})]),
    ('[{"name": "get_user", "arguments": {}}, {"name": "done", "arguments": {}}]', [("get_user", {}), ("done", {})]),
    ('{"name": "rm_rf", "arguments": {}}', []),  # not an offered tool
    ('The user {name} is fine.', []),
    ('{"name": "get_user", "arguments": "not json"}', []),
])
def test_parse_tool_calls(text, expected):
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, NAMES)] == expected


@pytest.mark.parametrize("raw,expected", [(None, {}), ("", {}), ('{"a": 1}', {"a": 1}), ("{bad", None),
                                          ("[1, 2]", None), ('"text"', None)])
def test_tool_arguments_are_a_json_object_or_none(raw, expected):
    from trace_rl.core.episode import decode_tool_calls, tool_arguments

    assert tool_arguments(raw) == expected
    call = {"id": "c1", "type": "function", "function": {"name": "get_user", "arguments": raw}}
    assert decode_tool_calls([call]) == [("c1", "get_user", expected)]


def test_extract_json_fenced_and_bare():
    assert extract_json('x ```json\n{"a": 1}\n``` y') == {"a": 1}
    assert extract_json('{"q": "a\tb\x01c"}') == {"q": "a\tb\x01c"}  # raw control characters a grammar let through
    assert extract_json('answer: [1, 2] done') == [1, 2]
    with pytest.raises(ValueError):
        extract_json("no json here")


class Pick(BaseModel):
    label: str
    score: float


def test_structured_retries_with_validation_error():
    llm = ScriptedLLM(['{"label": "x"}', 'not json', '{"label": "x", "score": 0.5}'])
    out = llm.structured([{"role": "user", "content": "go"}], Pick)
    assert out == Pick(label="x", score=0.5)
    # the model was shown its error before the retry
    assert "score" in llm.requests[1][-1]["content"] and llm.requests[1][-1]["role"] == "user"
    assert llm.usage.calls == 3 and llm.usage.prompt_tokens == 30


def test_structured_gives_up():
    llm = ScriptedLLM(["nope"] * 2)
    with pytest.raises(StructuredOutputError, match="Pick"):
        llm.structured([{"role": "user", "content": "go"}], Pick, attempts=2)


def test_chat_recovers_tool_call_from_text():
    llm = ScriptedLLM(['```json\n{"name": "done", "arguments": {}}\n```'])
    tools = [{"type": "function", "function": {"name": "done", "parameters": {"type": "object", "properties": {}}}}]
    r = llm.chat([{"role": "user", "content": "x"}], tools=tools)
    assert [c.name for c in r.tool_calls] == ["done"] and r.tool_calls_from_text
    assert r.to_message()["tool_calls"][0]["function"]["name"] == "done"


@pytest.mark.ci
@pytest.mark.slow
def test_real_served_model_returns_parsed_tool_call(qwen05_server):
    from trace_rl.models.llm import LLM

    llm = LLM(model=qwen05_server.model_name, base_url=qwen05_server.base_url, max_tokens=64)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.tool_calls and r.tool_calls[0].name == "get_weather"
    assert "paris" in str(r.tool_calls[0].arguments.get("city", "")).lower()
    assert llm.usage.calls == 1 and llm.usage.completion_tokens > 0


def test_structured_asks_for_schema_constrained_decoding_in_the_endpoints_dialect():
    from doubles import ScriptedLLM, endpoint_error
    from trace_rl.agents.analyst import Candidates

    class Capture(ScriptedLLM):
        def __init__(self, script, reject=None):
            super().__init__(script)
            self.kws, self.reject = [], reject

        def _complete(self, messages, tools, **kw):
            self.kws.append(kw)
            if self.reject and "response_format" in kw:
                raise endpoint_error(*self.reject)
            return super()._complete(messages, tools, **kw)

    one = ('{"capabilities": [{"name": "tool_precision", "description": "Calls tools with the right arguments. '
           'It checks ids.", "example_task_ids": ["t1"]}]}')
    local = Capture([one])
    local.structured([{"role": "user", "content": "x"}], Candidates)
    fmt = local.kws[0]["response_format"]
    assert fmt["type"] == "json_object"  # llama-cpp-python's server: a grammar from the schema
    assert fmt["schema"]["$defs"]["Capability"]["properties"]["name"]["pattern"].startswith("^[a-z]")
    remote = Capture([one])
    remote.config.base_url = "http://127.0.0.1:1/v1"
    remote.structured([{"role": "user", "content": "x"}], Candidates)
    assert remote.kws[0]["response_format"]["type"] == "json_schema"  # vLLM / OpenAI
    for reject in [(400, "unsupported response_format"), (422, "body.response_format: field required")]:
        refusing = Capture([one], reject=reject)
        assert refusing.structured([{"role": "user", "content": "x"}], Candidates).capabilities[0].name == "tool_precision"
        assert "response_format" not in refusing.kws[-1]  # fell back to plain prompting
    broken = Capture([one], reject=(500, "the server crashed"))
    with pytest.raises(openai.InternalServerError):  # not a refusal of the format: raised, not retried
        broken.structured([{"role": "user", "content": "x"}], Candidates)


def test_extract_json_escapes_a_small_models_inner_quotes_and_newlines():
    # the 1.5B on an endpoint without a grammar (the engine's server), verbatim in shape
    reply = ('```json\n{"capabilities": [{"name": "tool_argument_precision", "description": "passes the '
             'wrong arguments to "connect_wifi" or "enable_roaming".\nIt retries", "ids": ["a/0", "b/3"]}]}\n```')
    got = extract_json(reply)
    assert got["capabilities"][0]["description"] == ('passes the wrong arguments to "connect_wifi" or '
                                                     '"enable_roaming".\nIt retries')
    assert got["capabilities"][0]["ids"] == ["a/0", "b/3"]
    assert extract_json('{"a": "b\\"c"}') == {"a": 'b"c'}  # valid JSON is read strictly, escapes kept
    with pytest.raises(ValueError):
        extract_json("no json here")


def test_servers_that_apply_a_lora_are_stopped_and_the_others_kept(monkeypatch):
    import trace_rl.models.llm as llm_mod
    from trace_rl.models.endpoints import Endpoints

    class Srv:
        stopped = False

        def start(self):
            return self

        def stop(self):
            self.stopped = True

    base, adapter, engine = Srv(), Srv(), Srv()
    registry = Endpoints()
    monkeypatch.setattr(llm_mod, "ENDPOINTS", registry)
    for key, srv in ((("llama.cpp", "m", 2048, "agent", None), base), (("llama.cpp", "m", 2048, "agent", "/ad/a"), adapter),
                     (("hf", "m"), engine)):
        assert registry.get(key, lambda srv=srv: srv) is srv
    assert registry.get(("hf", "m"), lambda: Srv()) is engine  # started once per key
    assert llm_mod.stop_lora_endpoints() == 1
    assert adapter.stopped and not base.stopped and not engine.stopped
    assert registry.get(("llama.cpp", "m", 2048, "agent", "/ad/a"), lambda: adapter) is adapter  # started again


@pytest.mark.parametrize("behaviour", ["hang", "drip"])
def test_an_endpoint_that_hangs_or_drips_fails_the_request_at_its_deadline(behaviour):
    """A server that answers nothing, or one byte every 0.3 s (which never trips a read timeout), holds a
    request for its deadline, not for 600 s x 3; the next request gets a fresh client."""
    import socket
    import threading
    import time

    from trace_rl.models.chat import RequestDeadlineError
    from trace_rl.models.llm import LLM, LLMConfig

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.recv(65536)
            if behaviour == "drip":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                while not stop.is_set():
                    with suppress_errors():
                        conn.sendall(b" ")
                    time.sleep(0.3)
            else:
                stop.wait(10)
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    llm = LLM(LLMConfig(model="m", base_url=f"http://127.0.0.1:{srv.getsockname()[1]}/v1", timeout=2, deadline=1.5,
                        retries=0))
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            with pytest.raises(RequestDeadlineError, match="1.5 s deadline"):
                llm.chat([{"role": "user", "content": "hi"}])
            assert time.perf_counter() - t0 < 4
    finally:
        stop.set()
        srv.close()


def suppress_errors():
    import contextlib

    return contextlib.suppress(OSError)


def test_a_request_without_a_deadline_is_answered():
    """The deadline defaults to the client's timeout: an endpoint that answers at once is answered."""
    from fake_openai import FakeOpenAI

    from trace_rl.models.llm import LLM, LLMConfig

    with FakeOpenAI(tokens=5) as fake:
        reply = LLM(LLMConfig(model="m", base_url=fake.base_url, timeout=30)).chat([{"role": "user", "content": "hi"}])
    assert reply.content == "xxxxx" and reply.prompt_tokens == 3


def test_requests_go_to_several_endpoints_in_turn_and_an_llm_pickles_without_its_clients():
    """base_url as a list (a fleet of servers behind no balancer, #44): one request each in turn; an LLM shipped
    to another process (executor=ray) makes its clients there."""
    import pickle

    from fake_openai import FakeOpenAI

    from trace_rl.models.llm import LLM, LLMConfig

    with FakeOpenAI(tokens=1) as a, FakeOpenAI(tokens=2) as b:  # told apart by their replies' length
        cfg = LLMConfig(model="m", base_url=[a.base_url, b.base_url], timeout=30)
        assert cfg.base_url.count(",") == 1  # kept as one comma-separated string
        llm = LLM(cfg)
        hi = [{"role": "user", "content": "hi"}]
        assert [llm.chat(hi).content for _ in range(4)] == ["x", "xx", "x", "xx"]
        copy = pickle.loads(pickle.dumps(llm))
        assert copy._clients is None and [copy.chat(hi).content for _ in range(2)] == ["x", "xx"]
