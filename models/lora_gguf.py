"""A peft LoRA adapter as a llama.cpp GGUF LoRA, so that a single-adapter agent decodes in llama.cpp
(on a CPU and τ²'s ~10k-token prompts much faster than fp32 transformers) on the same quantised base it was
trained from.

The adapter was trained on `hf_checkpoint(base)`, the GGUF's own weights de-quantised; llama.cpp applies
`scale * B @ A` (scale = alpha / r) to the GGUF's tensors. What differs between the two layouts:
tensor names (peft's `...layers.3.self_attn.q_proj` is llama.cpp's `blk.3.attn_q`), and for LLaMA-type
models the rows of q and k, which the GGUF keeps permuted for its rotary embedding (transformers undoes
that permutation on load, so B's rows must be permuted back).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from trace_rl.core.io import atomic_write

MODULES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
PERMUTED_ARCHS = {"llama", "mistral"}  # q/k rows interleaved for rotary embedding in their GGUFs


class LoraConversionError(ValueError):
    pass


def permute(w, n_head: int):
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_lora(adapter_dir: str | Path, base_gguf: str | Path, out: str | Path | None = None) -> Path:
    """Write `adapter_dir` (peft: adapter_config.json + adapter_model.safetensors) as a GGUF LoRA for
    `base_gguf`; returns its path (`adapter.gguf` beside the adapter unless `out`). Done once per adapter."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    out = Path(out) if out else adapter_dir / "adapter.gguf"
    weights_file = adapter_dir / "adapter_model.safetensors"
    if out.is_file() and out.stat().st_mtime >= max(weights_file.stat().st_mtime, Path(base_gguf).stat().st_mtime):
        return out
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraConversionError(f"{adapter_dir}: DoRA and per-module rank/alpha patterns have no llama.cpp form; "
                                  "train a plain LoRA (one r and lora_alpha)")
    r = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", r)) * (r ** 0.5 if config.get("use_rslora") else 1.0)  # scale alpha/r
    reader = gguf.GGUFReader(str(base_gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = lambda key: int(reader.fields[f"{arch}.{key}"].parts[-1][0])
    n_head = field("attention.head_count")
    heads = {"attn_q": n_head, "attn_k": field("attention.head_count_kv")
             if f"{arch}.attention.head_count_kv" in reader.fields else n_head}
    base_names = {t.name for t in reader.tensors}

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in load_file(str(weights_file)).items():  # torch: bf16 adapters too
        m = re.search(r"layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$", key)
        if not m or m.group(2) not in MODULES:
            raise LoraConversionError(f"{adapter_dir}: adapter tensor {key} has no llama.cpp counterpart "
                                      f"(supported: {', '.join(MODULES)})")
        name = f"blk.{m.group(1)}.{MODULES[m.group(2)]}.weight"
        if name not in base_names:
            raise LoraConversionError(f"{adapter_dir}: {key} -> {name}, which {Path(base_gguf).name} lacks: "
                                      "is this adapter for another base model?")
        pairs.setdefault(name, {})[m.group(3)] = value.float().numpy()

    writer = gguf.GGUFWriter(None, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, ab in sorted(pairs.items()):
        a, b = ab["A"], ab["B"]  # peft: A (r, in), B (out, r) = llama.cpp's lora_a [in, r], lora_b [r, out]
        kind = name.split(".")[2]
        if arch in PERMUTED_ARCHS and kind in heads:
            b = permute(b, heads[kind])
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))

    def write(tmp: Path) -> None:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(out, write)
    return out
