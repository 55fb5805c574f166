"""The MoE composer on a tiny random model of a real architecture (Qwen2)."""
import pytest
import torch
from tiny import routing_fractions
from transformers import Qwen2Config, Qwen2ForCausalLM

from trace_rl.training.moe import Adapter, LoRAMoE

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_base(seed=0, init=0.02, hidden=32):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=init)
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
    assert routing_fractions(moe)[0] == 1.0


def test_the_adapter_share_counts_the_routes_that_leave_the_base(setup):
    """0 while every gate keeps BASE_BIAS's start (the moe decodes as the base), 1 once every gate prefers an
    adapter, and per layer in between."""
    from trace_rl.training.moe import adapter_share

    ids, _, adapters = setup
    moe = LoRAMoE(tiny_base(), adapters)
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]
    assert adapter_share(moe, rows) == 0.0
    with torch.no_grad():
        for gate in moe.gates:
            gate.proj.bias[2] = 10.0  # adapter 2 over the base's 5.0 for every token
    assert adapter_share(moe, rows) == 1.0
    with torch.no_grad():
        moe.gates[0].proj.bias[2] = 0.0  # the first of the two layers back on the base
    assert adapter_share(moe, rows) == 0.5


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


# ---------------------------------------------------------------- gate training learns to route
ALL_LINEAR = TARGETS + ["gate_proj", "up_proj", "down_proj"]
WIDE = 0.2  # init std: a 0.02 tiny model's logits span about ±0.6, too flat for any adapter to matter
HIDDEN = 256  # at 32 wide, the method's lr 5e-4 moves a gate too little in 120 steps to leave the base slot
SPAN = 10  # tokens per skill: few enough that even layer 0 (raw embeddings) can separate them linearly


def skill_batch(skill: int, n: int, gen, pairs: int = 6):
    """Pairs (x, marker): skill 1 draws x from 10.. with marker 5, skill 2 from 70.. with
    marker 6. Only the marker is scored: it follows from the skill, x does not."""
    lo, mark = (10, 5) if skill == 1 else (70, 6)
    x = lo + torch.randint(0, SPAN, (n, pairs), generator=gen)
    ids = torch.stack([x, torch.full_like(x, mark)], -1).reshape(n, 2 * pairs)
    labels = ids.clone()
    labels[:, 0::2] = -100
    return {"input_ids": ids, "labels": labels}


def train_skill_adapter(skill: int, steps: int = 60):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_base(init=WIDE, hidden=HIDDEN), LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR,
                                                            lora_dropout=0.0), adapter_name=f"skill{skill}")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(skill)
    model.train()
    for _ in range(steps):
        loss = model(**skill_batch(skill, 32, gen)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return Adapter.from_peft(f"skill{skill}", model.eval())


def test_gate_training_learns_to_route_two_skills():
    """Straight-through gates move off the base slot and send each skill to its own adapter."""
    from trace_rl.training.moe import train_gates

    adapters = [train_skill_adapter(1), train_skill_adapter(2)]
    moe = LoRAMoE(tiny_base(init=WIDE, hidden=HIDDEN), adapters)
    gen = torch.Generator().manual_seed(7)
    mixed = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in
             ((skill_batch(1, 16, gen), skill_batch(2, 16, gen)) for _ in range(40))]
    tests = {1: skill_batch(1, 64, gen), 2: skill_batch(2, 64, gen)}

    def evaluate(skill, slot=None):
        """(loss, precision, coverage) on the scored positions: precision = share of adapter
        choices that pick the skill's own adapter; coverage = share of tokens that reach it in
        at least one layer."""
        moe.force(slot)
        with torch.no_grad():
            loss = float(moe(**tests[skill]).loss)
        scored = torch.zeros_like(tests[skill]["labels"], dtype=torch.bool)
        scored[:, :-1] = tests[skill]["labels"][:, 1:] != -100  # position i predicts label i + 1
        routes = torch.stack([r.route for r in moe.routings])[:, scored]  # [layers, scored tokens]
        chose = routes[routes != 0]
        return loss, float((chose == skill).float().mean()), float((routes == skill).any(0).float().mean())

    base = {k: evaluate(k, 0)[0] for k in (1, 2)}
    own = {k: evaluate(k, k)[0] for k in (1, 2)}
    other = {k: evaluate(k, 3 - k)[0] for k in (1, 2)}
    from trace_rl.graph.config import ComposeSettings

    c = ComposeSettings()  # the shipped defaults (TRACE §5: lr 5e-4, wd 0.01, 3 epochs, λ_LB 1e-3)
    losses = train_gates(moe, mixed, epochs=c.epochs, lr=c.lr, weight_decay=c.weight_decay, lb_weight=c.lb_weight)
    learned = {k: evaluate(k) for k in (1, 2)}
    precision = sum(v[1] for v in learned.values()) / 2
    coverage = sum(v[2] for v in learned.values()) / 2
    print(f"\nrouting precision {precision:.3f}, coverage {coverage:.3f}; loss: base {base}, own adapter {own}, "
          f"other adapter {other}, MoE {({k: round(v[0], 3) for k, v in learned.items()})}; "
          f"gate training loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    for k in (1, 2):
        assert own[k] < base[k] - 1.0 and own[k] < other[k] - 1.0  # each adapter learned its own skill only
        assert learned[k][0] < own[k] + 0.25  # the MoE does about as well as the right adapter
    assert precision > 0.95 and coverage > 0.95


def test_checkpointed_gate_training_takes_the_same_steps():
    """Gradient checkpointing (on for long τ² episodes) recomputes each layer in the backward pass,
    reading the routing its gate decided: the losses and the trained gates must match a run that
    keeps every activation."""
    from trace_rl.training.moe import train_gates

    gen = torch.Generator().manual_seed(3)
    batches = [{"input_ids": (ids := torch.randint(0, 128, (2, 12), generator=gen)), "labels": ids} for _ in range(3)]
    runs, attention_calls = {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the gates' initialisation
        moe = LoRAMoE(tiny_base(), [random_adapter(f"cap{i}", 10 + i)[1] for i in range(2)])
        calls = []
        moe.model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        losses = train_gates(moe, batches, epochs=2, lr=1e-2, checkpointing=checkpointing)
        attention_calls[checkpointing] = len(calls)
        assert not moe.model.training and not moe.model.is_gradient_checkpointing  # left as it was found
        runs[checkpointing] = losses, [p.detach().clone() for p in moe.gate_parameters()]
    assert attention_calls[True] == 2 * attention_calls[False] == 12  # recomputed in each backward pass
    torch.testing.assert_close(runs[True][0], runs[False][0])
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in runs[True][1])


@pytest.mark.parametrize("shape,dtype", [((4, 3, 32), torch.float32), ((4, 32), torch.bfloat16)])
def test_the_slot_by_slot_decision_for_inductor_is_the_gates_decision(setup, shape, dtype):
    """`LayerGate._decide_by_slot` (what compiled decoding runs) against `decide` (eager): the same
    routes and masks for learned gates, exact ties and near-ties (argmax's first slot), rows fixed by
    `route_rows`, and a row whose logits are all -inf (the base, no NaN in the mask)."""
    moe = LoRAMoE(tiny_base(), setup[2])
    gate, routing = moe.gates[0], moe.routings[0]
    hidden = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        gate.proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        gate.proj.bias.zero_()
        gate.proj.weight[2] = gate.proj.weight[1]  # slots 1 and 2 tie on every token
        routes = []
        for slots in [None, torch.tensor([-1, 0, 3, -1]), torch.tensor([-1, 9, 9, 2])]:  # 9: no such slot
            moe.route_rows(slots)
            gate.decide(None, (hidden,), {})
            want = routing.route, routing.mask, routing.probs
            gate._decide_by_slot(hidden)
            assert torch.equal(routing.route, want[0])
            assert routing.mask.dtype == dtype and not routing.mask.isnan().any()
            torch.testing.assert_close(routing.mask, want[1])
            torch.testing.assert_close(routing.probs, want[2], equal_nan=True)
            routes.append(routing.route)
    assert 2 not in routes[0] and routes[0].ne(0).any()  # adapters chosen; the (near-)ties went to slot 1
    assert routes[1][1].eq(0).all() and routes[1][2].eq(3).all()  # fixed rows kept their slot
    assert routes[2][1].eq(0).all() and routes[2][3].eq(2).all()  # all -inf: the base
    with torch.no_grad():  # a near-tie: slots 1 and 2 differ in logit (0 and 1e-9), not in probability
        gate.proj.weight[1:3] = 0
        gate.proj.bias.copy_(torch.tensor([-20.0, 0.0, 1e-9, -20.0]))
        moe.route_rows(None)
        gate.decide(None, (hidden,), {})
        want = routing.route
        gate._decide_by_slot(hidden)
    assert want.eq(1).all() and torch.equal(routing.route, want)
