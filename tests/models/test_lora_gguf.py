"""peft adapters as llama.cpp GGUF LoRAs: llama.cpp's logit change matches transformers' for the same adapter."""
import json

import numpy as np
import pytest
from trace_rl.models import lora_gguf
from trace_rl.models.lora_gguf import LoraConversionError, gguf_lora
from trace_rl.models.weights import gguf_path, hf_checkpoint

TEXT = "The agent must look up the customer's account before changing the plan, then confirm the change."


def random_adapter(base, targets: list[str], std: float, out):
    """A peft LoRA with random B (peft starts B at zero: no effect to compare), saved to `out`;
    returns transformers' logits without and with it."""
    import torch
    from peft import LoraConfig, get_peft_model

    ids = torch.tensor([tokens(base)])
    with torch.no_grad():
        before = base(ids).logits[0].numpy()
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    with torch.no_grad():
        after = model(ids).logits[0].numpy()
    model.save_pretrained(out)
    model.unload()
    return before, after


def tokens(base) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base.name_or_path)(TEXT)["input_ids"]


def llama_logits(model: str, ids: list[int], lora=None) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(str(gguf_path(model)), lora_path=str(lora) if lora else None, logits_all=True, n_ctx=256,
                n_threads=2, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def corr(a, b) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.fixture(scope="module")
def smollm():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_checkpoint("smollm2-135m"), dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.ci
def test_llama_cpp_applies_a_converted_adapter_as_transformers_does(smollm, tmp_path):
    """SmolLM2 is a LLaMA: its GGUF keeps q/k rows permuted, so the conversion must permute B's rows too."""
    ids = tokens(smollm)
    base_ll = llama_logits("smollm2-135m", ids)
    hf_before, hf_after = random_adapter(smollm, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"], 0.05, tmp_path / "all")
    converted = gguf_lora(tmp_path / "all", gguf_path("smollm2-135m"))
    assert converted == tmp_path / "all" / "adapter.gguf"
    assert corr(hf_after - hf_before, llama_logits("smollm2-135m", ids, converted) - base_ll) > 0.85

    hf_before, hf_after = random_adapter(smollm, ["q_proj", "k_proj"], 0.2, tmp_path / "qk")
    right = corr(hf_after - hf_before, llama_logits("smollm2-135m", ids, gguf_lora(tmp_path / "qk",
                                                                                    gguf_path("smollm2-135m"))) - base_ll)
    lora_gguf.PERMUTED_ARCHS, saved = set(), lora_gguf.PERMUTED_ARCHS
    try:  # the same adapter without the permutation: what a naive copy would give
        wrong = corr(hf_after - hf_before, llama_logits("smollm2-135m", ids, gguf_lora(
            tmp_path / "qk", gguf_path("smollm2-135m"), out=tmp_path / "naive.gguf")) - base_ll)
    finally:
        lora_gguf.PERMUTED_ARCHS = saved
    assert right > 0.9 and wrong < right - 0.3, (right, wrong)


@pytest.mark.slow
@pytest.mark.ci
def test_adapters_without_a_llama_cpp_form_are_refused_with_the_reason(smollm, tmp_path):
    random_adapter(smollm, ["q_proj"], 0.01, tmp_path / "ok")
    weights = (tmp_path / "ok" / "adapter_model.safetensors").read_bytes()

    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(weights)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    for bad in ({"use_dora": True}, {"alpha_pattern": {"q_proj": 64}}):
        (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config | bad))
        with pytest.raises(LoraConversionError, match="DoRA and per-module"):
            gguf_lora(tmp_path / "dora", gguf_path("smollm2-135m"))

    with pytest.raises(LoraConversionError, match="another base model"):  # 30 layers' adapter on a 24-layer base
        gguf_lora(tmp_path / "ok", gguf_path("qwen2.5-coder-0.5b"))
    assert not (tmp_path / "ok" / "adapter.gguf").exists()  # nothing half-written


@pytest.mark.slow
@pytest.mark.ci
def test_an_agent_with_lora_is_served_by_llama_cpp_with_the_adapter_applied(smollm, tmp_path):
    from trace_rl.models.llm import LLM

    random_adapter(smollm, ["q_proj", "v_proj", "o_proj", "down_proj"], 0.3, tmp_path / "strong")
    ask = [{"role": "user", "content": "Name three colours."}]
    plain = LLM(model="smollm2-135m", n_ctx=512, max_tokens=16).chat(ask).content
    adapted = LLM(model="smollm2-135m", n_ctx=512, max_tokens=16, lora=str(tmp_path / "strong"))
    assert adapted.name == f"smollm2-135m+{tmp_path / 'strong'}"
    assert adapted.chat(ask).content != plain
    assert (tmp_path / "strong" / "adapter.gguf").is_file()
