"""One GRPO training run of the tiny model on the letters benchmark, launched plainly or under
torchrun; the generator is a deterministic function of each episode's tokens, so 1 and N
processes play the same episodes and must train the same adapter. Used by test_grpo."""
import hashlib
import sys

from tiny import LetterBench, tiny_model, tiny_tokenizer
from trace_rl.training.grpo import PRESETS, CapabilityGRPO


def scripted(tok):
    def gen(seqs, max_new):
        outs = []
        for s in seqs:  # hinted and plain prompts differ, so a group's rewards differ
            h = hashlib.sha256(str(s).encode()).digest()
            text = "".join("ab c"[b % 4] for b in h[:12])
            outs.append(tok(text)["input_ids"][:max_new - 1] + [tok.eos_token_id])
        return outs
    return gen


if __name__ == "__main__":
    out = sys.argv[1]
    tok = tiny_tokenizer()
    bench = LetterBench(n_tasks=16)
    g = CapabilityGRPO(tiny_model(tok), tok, bench, [t.id for t in bench.tasks()], out,
                       PRESETS["tiny"].model_copy(update={"steps": 2, "group_size": 4, "groups_per_step": 2,
                                                          "hint_fraction": 0.5, "log_kl": False}))
    g._generator = lambda trainer: scripted(tok)
    g.train()
