import pytest

from trace_rl.core.episode import template_messages


def test_template_messages_turn_argument_strings_into_dicts():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and out[0]["content"] == ""
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # input untouched


def test_llama_cpp_renders_a_tool_conversation_as_transformers_does(monkeypatch):
    """The embedded Qwen's own template, through llama-cpp-python's formatter as our server runs it
    and through transformers (training, the engine): one prompt, with the earlier call's arguments
    as the JSON object the model wrote, not a quoted string."""
    from gguf import GGUFReader
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from tiny import tiny_tokenizer
    from trace_rl.models.weights import gguf_path
    from trace_rl.models.llama_server import render_tool_arguments_as_objects
    from trace_rl.models.hf_policy import render

    field = GGUFReader(gguf_path("qwen2.5-coder-0.5b")).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    tools = [{"type": "function", "function": {"name": "get_customer", "description": "Find a customer.",
                                               "parameters": {"type": "object", "properties": {
                                                   "customer_id": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Help."}, {"role": "user", "content": "I am C1."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_customer", "arguments": '{"customer_id": "C1"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"name": "Ann"}'}]
    monkeypatch.setattr(Jinja2ChatFormatter, "__call__", Jinja2ChatFormatter.__call__)  # undone after the test
    render_tool_arguments_as_objects()
    served = Jinja2ChatFormatter(template=template, eos_token="<|im_end|>", bos_token="")(messages=msgs, tools=tools)
    tok = tiny_tokenizer()
    tok.chat_template = template
    assert served.prompt == render(tok, msgs, tools, add_generation_prompt=True)
    assert '{"name": "get_customer", "arguments": {"customer_id": "C1"}}' in served.prompt


@pytest.mark.ci
@pytest.mark.slow
@pytest.mark.docker
def test_in_process_policy_with_lora_runs_an_episode(tmp_path, sandbox_image):
    """transformers + a peft LoRA adapter drive the base agent loop on a sandboxed env."""
    from importlib import resources

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trace_rl.agents.base_agent import run_episode
    from trace_rl.evals.synthetic import SyntheticBenchmark
    from trace_rl.models.hf_policy import HFPolicy
    from trace_rl.models.weights import hf_checkpoint

    base = AutoModelForCausalLM.from_pretrained(hf_checkpoint("smollm2-135m"))
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "adapter")
    policy = HFPolicy.load("smollm2-135m", adapter=str(tmp_path / "adapter"), max_new_tokens=24)
    assert policy.name == "smollm2-135m+adapter"
    code = (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()
    with SyntheticBenchmark(code, seeds=range(2), pool_size=1) as bench:
        t = run_episode(policy, bench.episode("1"), task_id="1", benchmark=bench.name, max_steps=2)
    assert t.termination in ("agent_stop", "max_steps") and t.steps >= 1 and t.completion_tokens > 0
    assert 0.0 <= t.reward <= 1.0 and policy.usage.calls == t.steps


def test_a_second_turn_reuses_the_first_and_answers_as_a_fresh_model():
    """The second turn continues the first turn's cache row and must decode exactly as a fresh model."""
    from tiny import LetterEpisode, tiny_model, tiny_tokenizer
    from trace_rl.models.hf_policy import HFPolicy

    tok = tiny_tokenizer()
    model = tiny_model(tok)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    warm = HFPolicy(model, tok, "tiny", max_new_tokens=12)
    first = warm.chat(msgs, LetterEpisode.tools)
    fed = warm.batcher.engine.stats["prefill_tokens"]
    second = msgs + [first.to_message(), {"role": "user", "content": "more please"}]
    reused = warm.chat(second, LetterEpisode.tools)
    assert warm.usage.calls == 2 and warm.batcher.engine.stats["prefill_tokens"] - fed < reused.prompt_tokens / 2
    assert reused.content == HFPolicy(model, tok, "tiny", max_new_tokens=12).chat(second, LetterEpisode.tools).content


def test_templates_without_tools_get_them_as_text():
    from tiny import LetterEpisode, tiny_tokenizer
    from trace_rl.models.hf_policy import render

    call = {"id": "c1", "type": "function", "function": {"name": "get_user", "arguments": '{"user_id": "u1"}'}}
    text = render(tiny_tokenizer(), [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "", "tool_calls": [call]},
                                     {"role": "tool", "tool_call_id": "c1", "content": "{\"city\": \"Oslo\"}"}],
                  LetterEpisode.tools, add_generation_prompt=True)
    assert '"name": "get_user"' in text.split("<|im_start|>user")[0]  # schemas in the system prompt
    assert '<tool_call>\n{"name": "get_user", "arguments": {"user_id": "u1"}}\n</tool_call>' in text
    assert "<tool_response>\n{\"city\": \"Oslo\"}\n</tool_response>" in text and text.endswith("assistant\n")
