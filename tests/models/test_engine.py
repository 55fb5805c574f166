"""The batched static-cache engine: what it samples is what the model says, however rows are
padded, shared, continued or compacted; compiled and eager steps agree (MoE routing included)."""
import pytest
import torch

from tiny import routing_fractions, tiny_model, tiny_tokenizer
from trace_rl.models.engine import Batcher, Engine, Request
from trace_rl.models.hf_policy import encode, render


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """Large random weights: logits spiky enough that a wrong position or mask changes the argmax."""
    m = tiny_model(tok, seed=3, layers=2, hidden=64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5, generator=g)
    return m


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return encode(tok, render(tok, messages, add_generation_prompt=True))


def prompt(tok, text: str) -> list[int]:
    return chat_ids(tok, [{"role": "user", "content": text}])


def assert_greedy(model, ids: list[int], out: list[int]) -> None:
    """Each sampled token is the full (uncached, unpadded) forward's argmax at its position."""
    seq = torch.tensor([ids + out])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(ids) - 1:-1]
    for k, t in enumerate(out):
        assert logits[k, t] >= logits[k].max() - 1e-4, f"token {k}: {t} is not the argmax {int(logits[k].argmax())}"


def test_greedy_batch_of_different_lengths_matches_full_forwards(model, tok):
    eng = Engine(model, tok, rows=4, max_len=512)
    reqs = [Request(prompt(tok, t), 12) for t in ["Paris", "the answer is a b c d e", "Oslo Lima 0 1 2 3 4 5 6", "x"]]
    outs = eng.generate(reqs)
    assert all(1 <= len(o) <= 12 for o in outs)
    for r, o in zip(reqs, outs):
        assert_greedy(model, r.ids, o)


def test_a_continued_row_feeds_only_the_new_tokens(model, tok):
    eng = Engine(model, tok, rows=2, max_len=512)
    first = prompt(tok, "Paris Lima")
    out = eng.generate([Request(first, 6)])[0]
    fed = eng.stats["prefill_tokens"]
    follow = first + out + encode(tok, "<|im_end|>\n<|im_start|>user\nOslo<|im_end|>\n<|im_start|>assistant\n")
    out2 = eng.generate([Request(follow, 6)])[0]
    assert eng.stats["prefill_tokens"] - fed == len(follow) - len(first) - len(out) + 1  # +1: the last sampled token
    assert_greedy(model, follow, out2)


def test_a_shared_prefix_is_computed_once(model, tok):
    eng = Engine(model, tok, rows=4, max_len=1024)
    system = "You are a helpful assistant. Use the tools to answer the user. " * 3
    reqs = [Request(chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": u}]), 8)
            for u in ["Paris", "Lima 7", "Oslo"]]
    outs = eng.generate(reqs)
    shared = min(len(r.ids) for r in reqs) - 10
    assert eng.stats["reused_tokens"] >= 2 * shared  # the 2nd and 3rd request copied the 1st one's prefix
    assert eng.stats["prefill_tokens"] <= sum(len(r.ids) for r in reqs) - 2 * shared
    for r, o in zip(reqs, outs):
        assert_greedy(model, r.ids, o)


def test_full_columns_are_compacted_and_rows_stay_exact(model, tok):
    eng = Engine(model, tok, rows=3, max_len=160)
    convs = [prompt(tok, t) for t in ["a b", "c d e 0 1", "Paris"]]
    for turn in range(6):
        outs = eng.generate([Request(c, 8) for c in convs])
        for c, o in zip(convs, outs):
            assert_greedy(model, c, o)
        convs = [c + o + encode(tok, f"<|im_end|>\n<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n")
                 for c, o in zip(convs, outs)]
        convs = [c[-100:] if len(c) > 100 else c for c in convs]  # keep within max_len (a new row when cut)
    assert eng.stats["compactions"] >= 1


def test_rows_sample_at_their_own_temperature(model, tok):
    eng = Engine(model, tok, rows=4, max_len=256)
    ids = prompt(tok, "Lima")
    greedy_alone = Engine(model, tok, rows=1, max_len=256).generate([Request(ids, 10)])[0]
    torch.manual_seed(0)
    outs = eng.generate([Request(ids, 10, temperature=0.0), Request(ids, 10, temperature=5.0),
                         Request(ids, 10, temperature=5.0)])
    assert outs[0] == greedy_alone
    assert outs[1] != outs[2] or outs[1] != greedy_alone  # hot rows wander


def test_the_batcher_gathers_threads_into_one_batch(model, tok):
    import threading

    eng = Engine(model, tok, rows=4, max_len=256)
    batcher = Batcher(eng, window=0.5)
    reqs = [Request(prompt(tok, t), 5) for t in ["a", "b c", "Paris", "0 1 2"]]
    outs = [None] * 4
    calls = []
    real = eng.generate
    eng.generate = lambda rs: calls.append(len(rs)) or real(rs)
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, batcher.submit(reqs[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls == [4]
    for r, o in zip(reqs, outs):
        assert_greedy(model, r.ids, o)


def test_a_longer_request_grows_the_cache_and_one_beyond_the_model_is_refused(model, tok):
    eng = Engine(model, tok, rows=1, max_len=64)
    ids = prompt(tok, "Paris Lima Oslo " * 8)
    assert len(ids) + 10 > 64
    out = eng.generate([Request(ids, 10)])[0]
    assert eng.max_len >= len(ids) + 10
    assert_greedy(model, ids, out)
    with pytest.raises(ValueError, match="the model takes 4096"):
        eng.generate([Request([5] * 4090, 10)])


def _moe(model, tok, targets=("q_proj", "v_proj")):
    import copy

    from trace_rl.training.moe import Adapter, LoRAMoE

    base = copy.deepcopy(model)
    names = [n for n, m in base.named_modules() if n.endswith(targets)]
    g = torch.Generator().manual_seed(1)
    adapters = []
    for k in range(2):
        w = {}
        for n in names:
            lin = dict(base.named_modules())[n]
            w[n] = (torch.randn(4, lin.in_features, generator=g) * 0.3, torch.randn(lin.out_features, 4, generator=g) * 0.3)
        adapters.append(Adapter(f"a{k}", w, 1.0))
    moe = LoRAMoE(base, adapters)
    with torch.no_grad():  # gates that really route: adapter slots win on some tokens
        for gate in moe.gates:
            gate.proj.weight.normal_(0, 2.0, generator=g)
            gate.proj.bias.zero_()
    return moe


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj")],
                         ids=["base-stacked", "experts-stacked"])  # with k: the experts join the q/k/v stack
def test_moe_routing_is_exact_in_the_engine_and_under_compilation(model, tok, targets):
    moe = _moe(model, tok, targets)
    reqs = [Request(prompt(tok, t), 8) for t in ["Paris", "a b c d", "0 1 2 3 4 5"]]
    eager = Engine(moe, tok, rows=3, max_len=256, compile="eager").generate(reqs)
    for r, o in zip(reqs, eager):
        assert_greedy(moe, r.ids, o)
    fractions = routing_fractions(moe)
    assert fractions[0] < 0.99  # the adapters were really used
    compiled = Engine(moe, tok, rows=3, max_len=256, compile="inductor").generate(reqs)
    assert compiled == eager
    mixed = [Request(r.ids, 8, tag=t) for r, t in zip(reqs, [-1, 0, 2])]  # per row: the gates, base, adapter 2
    per_row = {mode: Engine(moe, tok, rows=3, max_len=256, compile=mode, before_forward=moe.route_rows).generate(mixed)
               for mode in ("eager", "inductor")}
    assert per_row["inductor"] == per_row["eager"] and per_row["eager"][0] == eager[0]
    stack = moe.model.model.layers[0].self_attn.q_proj.base.stack  # the compiled engine stacked the projections
    assert (stack.routing is not None) == ("k_proj" in targets)


def test_an_evaluations_modes_on_one_warm_engine_each_get_their_own_routing(model, tok):
    """The evaluation's pattern: modes one after another on one engine (base, base again as the
    router's pick, the learned gates), a task's trials together, several turns, columns compacted.
    A later mode reuses the cache an earlier one left: each token must still be the full forward's
    argmax under its own row's routing. (Checked after the proof run's router row, which routed
    every task to the base, differed from the base row; the engine was not the cause.)"""
    import random

    moe = _moe(model, tok)
    eng = Engine(moe, tok, rows=6, max_len=320, before_forward=moe.route_rows)
    rng = random.Random(0)
    words = "Paris Lima Oslo a b c d e 0 1 2 3 4 5 6 7 8 9".split()
    system = "You are a helpful assistant. Use the tools to answer the user. " * 3
    for slot in [0, 0, -1]:  # base, the router's base pick, the gates
        tickets = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) for _ in range(4)]
        convs = [[{"role": "system", "content": system + t}, {"role": "user", "content": "Solve the ticket."}]
                 for t in tickets for _ in range(2)]
        for turn in range(3):
            order = rng.sample(range(len(convs)), len(convs))
            for batch in (order[:5], order[5:]):
                reqs = [Request(chat_ids(tok, convs[c]), 6, tag=slot) for c in batch]
                for c, r, o in zip(batch, reqs, eng.generate(reqs)):
                    moe.force(None if slot < 0 else slot)
                    try:
                        assert_greedy(moe, r.ids, o)
                    finally:
                        moe.force(None)
                    convs[c] += [{"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)},
                                 {"role": "user", "content": " ".join(rng.sample(words, 4))}]
    assert eng.stats["reused_tokens"] > 0 and eng.stats["compactions"] >= 1  # the paths under test ran


def test_a_group_of_identical_long_prompts_fits_by_what_it_really_feeds(model, tok):
    """GRPO's group: one long prompt G times. Followers feed only their last token, so a cache
    that holds the prompt once (not G times) is enough: no compaction, no reset, no splitting."""
    eng = Engine(model, tok, rows=4, max_len=200)
    ids = prompt(tok, "Paris Lima Oslo a b c d e " * 7)
    assert 120 < len(ids) < 180, len(ids)
    outs = eng.generate([Request(ids, 8, 0.0)] * 4)
    assert eng.stats["compactions"] == 0 and eng.stats["prefill_tokens"] == len(ids) + 3
    assert all(o == outs[0] for o in outs)
    assert_greedy(model, ids, outs[0])


def test_a_cache_that_cannot_grow_leaves_the_engine_as_it_was(model, tok, monkeypatch):
    import trace_rl.models.engine as engine_mod

    eng = Engine(model, tok, rows=2, max_len=64)
    real = engine_mod.RowCache
    monkeypatch.setattr(engine_mod, "RowCache", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError):
        eng.generate([Request(prompt(tok, "Paris Lima Oslo " * 8), 10)])
    monkeypatch.setattr(engine_mod, "RowCache", real)
    ids = prompt(tok, "Paris")
    assert eng.max_len == 64 and eng.generate([Request(ids, 6)]) and eng.cache is not None


def test_a_grammar_holds_each_row_to_its_schema_and_leaves_free_rows_greedy(model, tok):
    """Random weights at T = 2 write anything; under the grammar every constrained reply is the
    schema's JSON, fields in the schema's order, ended by the stop token. Free rows in the same batch
    are still the model's argmax. Rows are permuted first (engine row != request index) and there are
    more requests than rows (the batch is split)."""
    import json

    from trace_rl.models.grammar import Grammars

    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "city", "n"],
              "properties": {"zeta": {"type": "boolean"}, "city": {"enum": ["Paris", "Lima", "Oslo"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    eng = Engine(model, tok, rows=4, max_len=512)
    first = prompt(tok, "warm up")
    eng.generate([Request(first, 4)])
    eng.generate([Request(first + eng.state[0].tokens[len(first):] + prompt(tok, "again")[1:], 2)])  # row 0 newest
    assigned, real_assign = [], eng._assign
    eng._assign = lambda reqs: (lambda out: assigned.append(out[0]) or out)(real_assign(reqs))
    grammars = Grammars(tok, eng.vocab_size, sorted(eng.stop_set))
    free_ids = [prompt(tok, "the answer is a b c"), prompt(tok, "Oslo 1 2")]
    torch.manual_seed(1)
    reqs = [Request(free_ids[0], 12), Request(prompt(tok, "Paris"), 64, 2.0, grammar=grammars.matcher(schema)),
            Request(prompt(tok, "x"), 64, 2.0, grammar=grammars.matcher(schema)), Request(free_ids[1], 12),
            Request(prompt(tok, "Lima"), 64, 2.0, grammar=grammars.matcher(schema))]
    outs = eng.generate(reqs)
    assert len(assigned) == 2 and assigned[0] != list(range(4))  # split in two; rows permuted
    for o in (outs[1], outs[2], outs[4]):
        assert o[-1] in eng.stop_set, f"reply not finished: {tok.decode(o)!r}"
        reply = json.loads(tok.decode(o[:-1]))
        assert list(reply) == ["zeta", "city", "n"] and reply["city"] in {"Paris", "Lima", "Oslo"}
        assert isinstance(reply["zeta"], bool) and 0 <= reply["n"] <= 9
    assert_greedy(model, free_ids[0], outs[0])
    assert_greedy(model, free_ids[1], outs[3])
    # the same prompt without the grammar is not JSON: the mask did the work
    torch.manual_seed(1)
    loose = eng.generate([Request(prompt(tok, "Paris"), 48, 2.0)])[0]
    with pytest.raises(ValueError):
        json.loads(tok.decode(loose).replace("<|im_end|>", ""))


def test_a_token_the_matcher_refuses_ends_the_row_before_it_is_fed(model, tok):
    """Should the mask and the matcher ever disagree, the refused token is not in the reply, and the row's
    record holds exactly what was fed: a continuation of it is still the model's argmax."""
    from trace_rl.models.grammar import Grammars

    eng = Engine(model, tok, rows=2, max_len=512)
    real = Grammars(tok, eng.vocab_size, sorted(eng.stop_set)).matcher({"type": "object"})

    class RefusesThird:
        seen = 0

        def fill_next_token_bitmask(self, mask, row):
            real.fill_next_token_bitmask(mask, row)

        def accept_token(self, t):
            self.seen += 1
            return self.seen < 3 and real.accept_token(t)

    ids = prompt(tok, "Paris")
    out = eng.generate([Request(ids, 32, 1.0, grammar=RefusesThird())])[0]
    assert len(out) == 2 and eng.state[0].tokens == ids + out and int(eng.n_real[0]) == len(ids) + 2
    follow = ids + out + encode(tok, "<|im_end|>\n<|im_start|>user\nOslo<|im_end|>\n<|im_start|>assistant\n")
    assert_greedy(model, follow, eng.generate([Request(follow, 6)])[0])


def test_the_two_stage_argmax_is_the_argmax():
    from trace_rl.models.engine import _argmax

    g = torch.Generator().manual_seed(0)
    for v in (151936, 1000, 130, 7):  # divisible by the chunks, not, fewer than them
        x = torch.randn(3, v, generator=g)
        x[1, v - 1] = 1e4  # the last column, the padded chunk's
        assert torch.equal(_argmax(x), x.argmax(-1)), v
