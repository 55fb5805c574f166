"""Composition on tiny models: adapters from disk, the four modes, the router, gate data, artefact."""
import pytest
import torch

from tiny import LetterEpisode, tiny_model, tiny_tokenizer
from trace_rl.training.compose import Composition, compose, gate_examples, load
from trace_rl.models.hf_policy import HFPolicy, assistant_labels
from trace_rl.training.moe import Adapter, LoRAMoE
from trace_rl.core.records import Capability

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
CAPS = [Capability(name="precondition_checking", description="Checks rules before acting."),
        Capability(name="tool_argument_precision", description="Passes exact ids to tools.")]
MSGS = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Go 1"}]


def saved_adapter(tok, path, seed):
    """A peft adapter with non-zero B saved to `path` (peft starts B at 0, which hides bugs)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(tok), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model.eval()


def test_adapter_from_dir_equals_from_peft(tmp_path):
    tok = tiny_tokenizer()
    peft_model = saved_adapter(tok, tmp_path / "a", 1)
    a, b = Adapter.from_dir("default", tmp_path / "a"), Adapter.from_peft("default", peft_model)
    assert a.scaling == b.scaling == 2.0 and a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k][0], b.weights[k][0]) and torch.equal(a.weights[k][1], b.weights[k][1])
               for k in a.weights)


def test_modes_reproduce_base_and_single_adapters(tmp_path):
    tok = tiny_tokenizer()
    peft_models = [saved_adapter(tok, tmp_path / c.name, i + 1) for i, c in enumerate(CAPS)]
    moe = LoRAMoE(tiny_model(tok), [Adapter.from_dir(c.name, tmp_path / c.name) for c in CAPS])
    comp = Composition(moe, tok, CAPS, max_new_tokens=10)
    assert comp.modes == ["base", "precondition_checking", "tool_argument_precision", "router", "moe"]
    want_base = HFPolicy(tiny_model(tok), tok, "base", max_new_tokens=10).chat(MSGS, LetterEpisode.tools).content
    assert comp.policy("base").chat(MSGS, LetterEpisode.tools).content == want_base
    for cap, pm in zip(CAPS, peft_models):
        want = HFPolicy(pm, tok, cap.name, max_new_tokens=10).chat(MSGS, LetterEpisode.tools).content
        assert comp.policy(cap.name).chat(MSGS, LetterEpisode.tools).content == want != want_base
    # the router decides once per conversation and its choice is a valid slot
    router = comp.policy("router")
    router.chat(MSGS, LetterEpisode.tools)
    router.chat(MSGS + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}], LetterEpisode.tools)
    assert len(comp.routes) == 1 and list(comp.routes.values())[0] in range(len(CAPS) + 1)
    assert "precondition_checking: Checks rules before acting." in comp.router.prompt(MSGS)


def test_assistant_labels_cover_exactly_the_assistant_turns():
    tok = tiny_tokenizer()
    call = {"id": "c", "type": "function", "function": {"name": "get_user", "arguments": '{"user_id": "u1"}'}}
    msgs = MSGS + [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c", "content": '{"city": "Oslo"}'},
                   {"role": "assistant", "content": "It is Oslo."}]
    ids, labels = assistant_labels(tok, msgs, LetterEpisode.tools)
    from trace_rl.models.hf_policy import encode, render

    assert ids == encode(tok, render(tok, msgs, LetterEpisode.tools))
    trained = tok.decode([i for i, l in zip(ids, labels) if l != -100])
    assert trained == ('<tool_call>\n{"name": "get_user", "arguments": {"user_id": "u1"}}\n</tool_call><|im_end|>\n'
                       "It is Oslo.<|im_end|>\n")
    assert "Oslo\"}" not in trained.split("It is")[0]  # the tool result is context, not a label


def test_compose_trains_gates_and_round_trips(tmp_path):
    tok = tiny_tokenizer()
    for i, c in enumerate(CAPS):
        saved_adapter(tok, tmp_path / c.name, i + 1)
    convs = [(MSGS + [{"role": "assistant", "content": "aaaa a"}], LetterEpisode.tools)] * 3
    assert len(gate_examples(tok, convs)[0]) == 3
    moe = compose(tiny_model(tok), tok, {c.name: tmp_path / c.name for c in CAPS}, CAPS, convs,
                  tmp_path / "moe", epochs=2, lr=1e-2)
    manifest = (tmp_path / "moe" / "manifest.json").read_text()
    assert '"examples": 3' in manifest and "precondition_checking" in manifest
    assert any(not torch.equal(g.proj.weight, torch.zeros_like(g.proj.weight)) for g in moe.gates)
    again = load(tiny_model(tok), tok, tmp_path / "moe")
    assert [c.name for c in again.caps] == [c.name for c in CAPS]
    ids = torch.tensor([[5, 6, 7, 8]])
    moe.force(None)
    again.moe.force(None)
    with torch.no_grad():
        torch.testing.assert_close(again.moe(input_ids=ids).logits, moe(input_ids=ids).logits)


def test_adapter_changed_tells_a_fresh_adapter_from_a_trained_one(tmp_path):
    """peft starts LoRA B at zero: an adapter saved untouched is exactly the base model."""
    from peft import LoraConfig, get_peft_model

    from trace_rl.training.grpo import adapter_changed

    tok = tiny_tokenizer()
    get_peft_model(tiny_model(tok), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).save_pretrained(tmp_path / "fresh")
    saved_adapter(tok, tmp_path / "trained", 3)
    assert not adapter_changed(tmp_path / "fresh") and adapter_changed(tmp_path / "trained")


def test_an_adapter_with_nan_weights_is_diverged_not_unchanged(tmp_path):
    """NaN > 0 is False: a plain "any B non-zero" check once reported a diverged adapter as untouched."""
    from safetensors.torch import load_file, save_file

    from trace_rl.training.grpo import DivergedAdapter, adapter_changed

    saved_adapter(tiny_tokenizer(), tmp_path / "a", 1)
    path = tmp_path / "a" / "adapter_model.safetensors"
    weights = {k: torch.full_like(t, float("nan")) if "lora_B" in k else t for k, t in load_file(str(path)).items()}
    save_file(weights, str(path))
    with pytest.raises(DivergedAdapter, match="diverged"):
        adapter_changed(tmp_path / "a")


def test_a_composition_without_gate_examples_is_marked(tmp_path):
    from trace_rl.training.compose import gates_untrained

    tok = tiny_tokenizer()
    saved_adapter(tok, tmp_path / "a", 1)
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, [Capability(name="a", description="d")], [], tmp_path / "c")
    assert gates_untrained(tmp_path / "c") == "0 successful rollouts to train them on"


def test_rollouts_longer_than_max_len_are_left_out_whole_and_named(tmp_path):
    """The GPU proof run's gates once saw 0 of 70 successful episodes: each was ~11k tokens and
    the rows were cut to their first 4096, which held no assistant token. A conversation too long
    is now left out whole, counted, and named as the reason."""
    from trace_rl.training.compose import gates_untrained

    tok = tiny_tokenizer()
    saved_adapter(tok, tmp_path / "a", 1)
    short = (MSGS + [{"role": "assistant", "content": "aaaa a"}], LetterEpisode.tools)
    long = ([{"role": "system", "content": "policy " * 400}, *short[0][1:]], LetterEpisode.tools)
    n_long = len(assistant_labels(tok, *long)[0])
    rows, too_long = gate_examples(tok, [short, long, long], max_len=n_long - 1)
    assert (len(rows), too_long) == (1, 2)
    assert all((r["labels"] != -100).any() for r in rows)
    caps = [Capability(name="a", description="d")]
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, caps, [long, long], tmp_path / "c", max_len=n_long - 1)
    assert gates_untrained(tmp_path / "c") == f"all 2 of 2 successful rollouts run past max_len={n_long - 1} tokens"
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, caps, [long], tmp_path / "d", max_len=n_long, sources={"a": 1})
    assert gates_untrained(tmp_path / "d") is None


def test_the_gate_summary_says_where_the_examples_came_from_and_how_the_loss_moved(tmp_path):
    """The proof run's moe row read against its gates: 72 rollouts, nearly all from one environment,
    and a loss that did not fall. The report says so beside the row."""
    import json

    from trace_rl.training.compose import gate_summary

    tok = tiny_tokenizer()
    saved_adapter(tok, tmp_path / "a", 1)
    short = (MSGS + [{"role": "assistant", "content": "aaaa a"}], LetterEpisode.tools)
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, [Capability(name="a", description="d")], [short, short],
            tmp_path / "c", epochs=2, sources={"a": 2})
    g = json.loads((tmp_path / "c" / "manifest.json").read_text())["gate_training"]
    assert g["from"] == {"a": 2}
    assert 0.0 <= g["adapter_share"] <= 1.0
    assert gate_summary(tmp_path / "c").startswith(f"gates trained on 2 successful rollouts (a: 2), 2 epochs, "
                                                   f"loss {g['loss_first']:.3f} → {g['loss_last']:.3f}; "
                                                   f"{g['adapter_share']:.0%} of token routes to an adapter")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["gate_training"]["adapter_share"] = 0.0  # every gate still on the base slot: the row must say so
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    assert gate_summary(tmp_path / "c").endswith("0% of token routes to an adapter (every gate still prefers the "
                                                 "base: the moe decodes as the base)")
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, [Capability(name="a", description="d")], [], tmp_path / "e")
    assert gate_summary(tmp_path / "e") == "gates untrained: 0 successful rollouts to train them on"
    compose(tiny_model(tok), tok, {"a": tmp_path / "a"}, [Capability(name="a", description="d")], [short], tmp_path / "z",
            epochs=0)  # examples, but not one step: the moe is the base
    assert gate_summary(tmp_path / "z") == "gates untrained: 0 gate steps (0 epochs on 1 successful rollouts)"


ROUTER_CAPS = [
    Capability(name="flight_cancellation_rules", description="Decides whether an airline reservation may be cancelled and refunded under the airline's rules."),
    Capability(name="mobile_data_troubleshooting", description="Fixes a phone whose mobile data or internet does not work (airplane mode, data saver, roaming)."),
]
ROUTER_TASKS = [  # (first user message, the right option: 1 = flights, 2 = phone)
    ("I need to cancel my flight reservation ABC123 and get my money back.", 1),
    ("Can I cancel the trip I booked yesterday from Boston to Denver? I want a refund.", 1),
    ("My phone says no internet. Mobile data is not working since this morning.", 2),
    ("I'm abroad and my cell phone has no data connection at all, please help me fix it.", 2),
]


@pytest.mark.slow
@pytest.mark.ci
def test_classifier_router_picks_the_planted_adapter_with_the_embedded_model():
    """The per-task router baseline reads the capability descriptions with the embedded 1.5B
    (shipped prompt) and must pick the right adapter, not just a slot. (The 0.5B cannot: its
    letter scores barely depend on the task, so it is at chance even with the order averaged.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_rl.training.compose import ClassifierRouter
    from trace_rl.models.weights import hf_checkpoint

    path = hf_checkpoint("qwen2.5-coder-1.5b")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    module = "model.layers.0.self_attn.q_proj"
    dim = model.config.hidden_size
    adapters = [Adapter(c.name, {module: (torch.zeros(2, dim), torch.zeros(dim, 2))}, 1.0) for c in ROUTER_CAPS]
    router = ClassifierRouter(LoRAMoE(model, adapters), tok, ROUTER_CAPS)
    chosen = [router.choose([{"role": "system", "content": "You are a customer service agent."},
                             {"role": "user", "content": text}]) for text, _ in ROUTER_TASKS]
    assert chosen == [right for _, right in ROUTER_TASKS], chosen


def test_the_router_row_decodes_exactly_as_the_mode_it_chose(tmp_path):
    """The router's scoring forward shares the model with the engine: after it, the row must decode
    token for token as the mode it picked (the GPU proof run's router row, which by an offline
    recomputation picked the base everywhere, ended in an error twice as often as the base row)."""
    tok = tiny_tokenizer()
    for i, c in enumerate(CAPS):
        saved_adapter(tok, tmp_path / c.name, i + 1)
    moe = LoRAMoE(tiny_model(tok), [Adapter.from_dir(c.name, tmp_path / c.name) for c in CAPS])
    comp = Composition(moe, tok, CAPS, max_new_tokens=12)
    later = MSGS + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    routed = [comp.policy("router").chat(m, LetterEpisode.tools).content for m in (MSGS, later)]
    chosen = comp.modes[comp.router.choose(MSGS)]
    assert comp.route_counts([MSGS, later]) == {chosen: 2}  # per episode; one task, one choice
    resumed = Composition(moe, tok, CAPS, max_new_tokens=12)  # a resumed evaluation routed nothing yet
    assert resumed.route_counts([MSGS]) == {chosen: 1}
    assert routed == [comp.policy(chosen).chat(m, LetterEpisode.tools).content for m in (MSGS, later)]
