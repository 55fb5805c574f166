"""Stacked projections (models/fuse.py): the same outputs as the separate projections, for a
plain model, a peft LoRA and the routed MoE; gradients still reach trainable weights."""
import copy

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from trace_rl.models.fuse import fuse_projections
from trace_rl.training.moe import Adapter, LoRAMoE

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_tokenizer(), seed=3, layers=2, hidden=64)


@pytest.fixture
def ids():
    return torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def random_peft(model, name):
    from peft import LoraConfig, get_peft_model

    p = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), adapter_name=name)
    with torch.no_grad():
        for n, w in p.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.5)
    return p


def test_a_stacked_model_gives_the_same_logits_and_keeps_its_state_dict(model, ids):
    m = copy.deepcopy(model).requires_grad_(False)
    want, keys = logits(m, ids), set(m.state_dict())
    assert fuse_projections(m) == 4 and fuse_projections(m) == 0  # 2 layers x (q/k/v, gate/up); once
    assert torch.equal(logits(m, ids), want)
    assert set(m.state_dict()) == keys
    attn = m.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.stack.weight[64:].data_ptr()  # a view, not a copy
    assert attn.q_proj.stack.x is None  # the last member let go of the parts
    x = torch.randn(3, 64)  # a member called on its own computes its own product
    assert torch.allclose(attn.v_proj(x), x @ attn.v_proj.weight.T + attn.v_proj.bias, atol=1e-6)


def test_trainable_weights_still_get_their_gradients(model, ids):
    plain, fused = copy.deepcopy(model), copy.deepcopy(model)
    fuse_projections(fused)
    for m in (plain, fused):
        m(input_ids=ids).logits.square().mean().backward()
    for name in ("q_proj", "k_proj", "v_proj"):
        a, b = (getattr(m.model.layers[1].self_attn, name).weight.grad for m in (plain, fused))
        assert b is not None and torch.allclose(a, b, atol=1e-6)


def test_a_peft_lora_adds_its_update_on_top_of_the_stack_and_trains_as_before(model, ids):
    p = random_peft(model, "a")
    plain = copy.deepcopy(p)
    want = logits(p, ids)
    assert fuse_projections(p.get_base_model()) == 4
    assert torch.allclose(logits(p, ids), want, atol=1e-5)
    assert not torch.allclose(want, logits(model, ids), atol=1e-3)  # the adapter really changes the output
    for m in (plain, p):  # GRPO's case: the base frozen by peft (its product stacked), the adapter trained
        m(input_ids=ids).logits.square().mean().backward()
    grads = [{n: w.grad for n, w in m.named_parameters() if "lora_A" in n} for m in (plain, p)]
    assert len(grads[0]) == 8 and all(torch.allclose(grads[0][n], g, atol=1e-6) for n, g in grads[1].items())


def test_the_moes_routed_experts_join_the_stack_and_route_as_before(model, ids):
    moe = LoRAMoE(copy.deepcopy(model), [Adapter.from_peft(n, random_peft(model, n)) for n in ("a", "b")]).eval()
    with torch.no_grad():
        for g in moe.gates:
            g.proj.weight.normal_(0, 0.5)
            g.proj.bias.zero_()
    batches = [ids, ids[:, :3]]  # 22 rows: GEMMs; 6 rows: the thin products compile to multiply-sums (SUM_ROWS)
    want = {(slot, i): (moe.force(slot), logits(moe, x))[1] for slot in (None, 0, 1, 2) for i, x in enumerate(batches)}
    assert fuse_projections(moe.model) == 6  # 2 layers x (q/k/v, gate/up, o alone)
    attn = moe.model.model.layers[0].self_attn
    assert attn.q_proj.base.stack.routing is not None  # experts' A rows stacked
    assert attn.o_proj.base.weight.data_ptr() == attn.o_proj.base.stack.weight.data_ptr()  # o's too, under its weight
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)  # traceable as one graph
    for (slot, i), out in want.items():
        moe.force(slot)
        assert torch.allclose(logits(moe, batches[i]), out, atol=1e-5), slot
        assert torch.allclose(logits(compiled, batches[i]), out, atol=1e-5), slot
    moe.force(None)
    assert not torch.allclose(want[1, 0], want[2, 0], atol=1e-3)  # the experts differ
    o = attn.o_proj
    o.A_cat.data = torch.zeros_like(o.A_cat)  # a replaced tensor of a stack of one is re-linked too
    assert fuse_projections(moe.model) == 0 and o.A_cat.data_ptr() == o.base.stack.weight[64:].data_ptr()
    assert o.base.stack.weight[64:].abs().sum() == 0


def test_a_replaced_weight_is_stacked_again_on_the_next_call(model, ids):
    m = copy.deepcopy(model).requires_grad_(False)
    fuse_projections(m)
    attn = m.model.layers[1].self_attn
    stacked = attn.q_proj.stack.weight
    attn.k_proj.weight.data = torch.randn_like(attn.k_proj.weight)  # what a reload or an unsafe merge does
    plain = copy.deepcopy(model)
    plain.model.layers[1].self_attn.k_proj.weight.data = attn.k_proj.weight.data.clone()
    assert fuse_projections(m) == 0
    assert attn.q_proj.stack.weight is stacked  # same address: a captured graph sees the new values
    assert torch.allclose(logits(m, ids), logits(plain, ids), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_a_thin_product_is_the_same_written_as_a_sum_while_compiling(rows):
    """small_matmul: a multiply-sum for <= SUM_ROWS rows under compilation, addmm/linear otherwise;
    both are `plus + a @ w.T`, with a 1-D plus (a bias) or a full one (the residual)."""
    from trace_rl.models.fuse import SUM_ROWS, small_matmul

    torch.compiler.reset()  # a fresh compile per case (one code object, several shapes)
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(1, rows, 12, generator=g), torch.randn(5, 12, generator=g)
    for plus in (None, torch.randn(5, generator=g), torch.randn(1, rows, 5, generator=g)):
        want = a @ w.T + (0 if plus is None else plus)
        assert torch.allclose(small_matmul(a, w, plus), want, atol=1e-5)
        traced = []

        def record(gm, inputs):  # a backend that keeps what was traced and runs it as it is
            traced.extend(str(n.target) for n in gm.graph.nodes)
            return gm.forward
        out = torch.compile(small_matmul, backend=record, fullgraph=True)(a, w, plus)
        assert torch.allclose(out, want, atol=1e-5)
        assert ("sum" in traced) == (rows <= SUM_ROWS), traced
