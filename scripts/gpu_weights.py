"""Carry an embedded model's weights to a GPU machine that can fetch nothing, in parts small enough
for one transfer each (the device tool carries at most 64 MiB a call).

    on the CPU machine:   python scripts/gpu_weights.py split qwen2.5-coder-1.5b --out .device/parts
                          (then, per call, one part in .device/chunk/, carried and moved to /tmp/parts/ there)
    on the GPU machine:   python scripts/gpu_weights.py join /tmp/parts qwen2.5-coder-1.5b
                          (reassembles into the model cache, checks the pinned sha256, then
                           `trace-rl models path NAME --hf` converts it for transformers)
"""
import argparse
import os
import sys
from pathlib import Path


def split(name: str, out: Path, mb: int) -> list[Path]:
    from trace_rl.models.weights import gguf_path

    src = gguf_path(name)  # assembled and sha256-checked here
    out.mkdir(parents=True, exist_ok=True)
    parts, size = [], mb << 20
    with open(src, "rb") as f:
        while block := f.read(size):
            part = out / f"{name}.gguf.{len(parts):03d}"
            part.write_bytes(block)
            parts.append(part)
    print(f"{src} ({src.stat().st_size / 1e6:.0f} MB) -> {len(parts)} parts of <= {mb} MiB in {out}")
    return parts


def join(parts_dir: Path, name: str) -> Path:
    from trace_rl.models.weights import get_model, models_dir, verify

    model = get_model(name)
    parts = sorted(parts_dir.glob(f"{name}.gguf.[0-9][0-9][0-9]"))
    if not parts:
        sys.exit(f"no parts {name}.gguf.NNN in {parts_dir}")
    numbers = [int(p.suffix[1:]) for p in parts]
    if numbers != list(range(len(parts))):
        sys.exit(f"parts missing: have {numbers}")
    dest = models_dir() / model.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".gguf.partial")
    with open(tmp, "wb") as out:
        for p in parts:
            out.write(p.read_bytes())
    os.replace(tmp, dest)
    if not verify(model, full=True):
        dest.unlink()
        sys.exit(f"{name}: the reassembled file does not match the pinned sha256 {model.sha256}; removed")
    print(f"{dest}: {len(parts)} parts, sha256 verified")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("name")
    s.add_argument("--out", type=Path, default=Path(".device/parts"))
    s.add_argument("--mb", type=int, default=56)
    j = sub.add_parser("join")
    j.add_argument("dir", type=Path)
    j.add_argument("name")
    args = ap.parse_args()
    if args.cmd == "split":
        split(args.name, args.out, args.mb)
    else:
        join(args.dir, args.name)


if __name__ == "__main__":
    main()
