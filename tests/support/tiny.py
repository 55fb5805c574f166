"""Tiny chat models for tests: a byte-level BPE tokenizer with a ChatML template (no tool
support, like SmolLM2's) and a random Qwen2 of a few thousand parameters. No weights needed."""
from __future__ import annotations

from letters import LetterBench, LetterEpisode  # noqa: F401  (the tests' toy benchmark)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["You are a helpful assistant. Use the tools to answer the user.",
          '<tool_call>\n{"name": "get_user", "arguments": {"user_id": "u1"}}\n</tool_call>',
          "<tool_response> city Paris Lima Oslo </tool_response> Done. The answer is a b c d e 0 1 2 3 4 5 6 7 8 9"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.padding_side = "left"
    return fast


def tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 32):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def save_tiny(path, seed: int = 0):
    """A tiny checkpoint on disk (what `hf_checkpoint` would return for a real model)."""
    tok = tiny_tokenizer()
    tiny_model(tok, seed).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def routing_fractions(moe) -> list[float]:
    """The share of tokens each slot (0 = base) got in a LoRAMoE's last forward."""
    import torch.nn.functional as F

    counts = sum(F.one_hot(r.route, len(moe.adapters) + 1).float().flatten(0, -2).sum(0)
                 for r in moe.routings if r.route is not None)
    return (counts / counts.sum()).tolist()
