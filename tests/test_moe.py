"""The MoE composer on a tiny random model of a real architecture (Qwen2)."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trace_rl.training.moe import Adapter, LoRAMoE

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_base(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def random_adapter(name, seed):
    """A peft LoRA adapter with non-zero B (peft initialises B = 0, which would hide bugs)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
                           adapter_name=name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), Adapter.from_peft(name, model)


@pytest.fixture(scope="module")
def setup():
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    peft_models, adapters = zip(*[random_adapter(f"cap{i}", 10 + i) for i in range(3)])
    return ids, peft_models, list(adapters)


def test_all_gates_at_base_slot_reproduce_base_exactly(setup):
    ids, _, adapters = setup
    base_logits = tiny_base()(ids).logits
    moe = LoRAMoE(tiny_base(), adapters)
    with torch.no_grad():
        out = moe(input_ids=ids).logits  # bias 5.0 on slot 0: every token starts on the base
    assert torch.equal(out, base_logits)
    assert moe.routing_fractions()[0] == 1.0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_forced_expert_reproduces_that_adapter(setup, k):
    ids, peft_models, adapters = setup
    with torch.no_grad():
        want = peft_models[k - 1](input_ids=ids).logits
        moe = LoRAMoE(tiny_base(), adapters)
        moe.force(k)
        got = moe(input_ids=ids).logits
    assert not torch.allclose(want, tiny_base()(ids).logits)  # the adapter does change the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_gates_train_and_artefact_round_trips(setup, tmp_path):
    ids, _, adapters = setup
    moe = LoRAMoE(tiny_base(), adapters)
    trainable = [n for n, p in moe.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("gates.") for n in trainable)
    assert sum(p.numel() for p in moe.gate_parameters()) == 2 * (32 * 4 + 4)
    with torch.no_grad():
        moe.gates[0].proj.bias.copy_(torch.tensor([0.0, 0.0, 3.0, 0.0]))
    moe.save(tmp_path)
    again = LoRAMoE.load(tiny_base(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, moe(input_ids=ids).logits)
