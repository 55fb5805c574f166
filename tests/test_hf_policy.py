import pytest

from trace_rl.training.hf_policy import template_messages


def test_template_messages_turn_argument_strings_into_dicts():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and out[0]["content"] == ""
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # input untouched


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
    from trace_rl.training.hf_policy import HFPolicy
    from trace_rl.training.models import hf_checkpoint

    base = AutoModelForCausalLM.from_pretrained(hf_checkpoint("smollm2-135m"))
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "adapter")
    policy = HFPolicy("smollm2-135m", adapter=str(tmp_path / "adapter"), max_new_tokens=24)
    assert policy.name == "smollm2-135m+adapter"
    code = (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()
    with SyntheticBenchmark(code, seeds=range(2), pool_size=1) as bench:
        t = run_episode(policy, bench.episode("1"), task_id="1", benchmark=bench.name, max_steps=2)
    assert t.termination in ("agent_stop", "max_steps") and t.steps >= 1 and t.completion_tokens > 0
    assert 0.0 <= t.reward <= 1.0 and policy.usage.calls == t.steps
