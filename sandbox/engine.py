"""Find or start a Docker engine; build the sandbox image offline.

No image registry is reachable, so the base image is made with debootstrap from the
Debian mirror apt already uses, imported with `docker import`, and the sandbox layer
is built on top with a normal Dockerfile. Both are tagged by a hash of their recipe,
so they are rebuilt only when the recipe changes.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from trace_rl.core.io import cache_dir

DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = "python3"
BASE_REPO = "trace-rl-base"
SANDBOX_REPO = "trace-rl-sandbox"


class DockerUnavailable(RuntimeError):
    pass


def _apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *packages], check=True, env=env, capture_output=True)


def _client():
    import docker

    return docker.from_env(timeout=120)


def engine_ok() -> bool:
    try:
        return bool(_client().ping())
    except Exception:
        return False


def ensure_engine(timeout: float = 90.0):
    """A docker client talking to a live engine, installing/starting dockerd if we may."""
    if engine_ok():
        return _client()
    if os.geteuid() != 0:
        raise DockerUnavailable(
            "no Docker engine answers on $DOCKER_HOST or /var/run/docker.sock. Start one "
            "(`sudo systemctl start docker`, or `sudo dockerd &`), or add yourself to the docker group.")
    if not shutil.which("dockerd"):
        _apt_install("docker.io")
    log = cache_dir() / "logs" / "dockerd.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        subprocess.Popen(["dockerd"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine_ok():
            return _client()
        time.sleep(1)
    raise DockerUnavailable(f"dockerd did not answer within {timeout:.0f}s; see {log}")


def debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (no other host is reachable)."""
    for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = p.read_text() if p.is_file() else ""
        for m in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s*)?)(\S+)", text, re.M):
            uri = m.group(1).rstrip("/")
            if "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


def _recipe_files() -> dict[str, bytes]:
    """The image's build context: sandbox/image/* and core/reward.py as reward.py (the one reward
    module, imported by trace_env.py inside the sandbox). The tag hashes all of them."""
    root = resources.files("trace_rl.sandbox") / "image"
    files = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}
    files["reward.py"] = (resources.files("trace_rl.core") / "reward.py").read_bytes()
    return dict(sorted(files.items()))


def runtime_files() -> dict[str, bytes]:
    """The Python files the image puts in /opt/trace_rl (runner.py, trace_env.py, reward.py and any
    sibling module): what a sandbox process needs on its path, whichever backend runs it."""
    return {name: data for name, data in _recipe_files().items() if name.endswith(".py")}


def base_tag() -> str:
    h = hashlib.sha256(f"{DEBIAN_SUITE}|{BASE_PACKAGES}|minbase".encode()).hexdigest()[:12]
    return f"{BASE_REPO}:{h}"


def sandbox_tag() -> str:
    h = hashlib.sha256(base_tag().encode())
    for name, data in _recipe_files().items():
        h.update(name.encode() + b"\0" + data)
    return f"{SANDBOX_REPO}:{h.hexdigest()[:12]}"


def _has_image(client, tag: str) -> bool:
    import docker

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def _build_base(tag: str, log=print) -> None:
    if not shutil.which("debootstrap"):
        if os.geteuid() != 0:
            raise DockerUnavailable("debootstrap is needed to build the sandbox base image: apt-get install debootstrap")
        _apt_install("debootstrap")
    with tempfile.TemporaryDirectory(prefix="trace-rl-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log(f"debootstrap {DEBIAN_SUITE} (minbase + {BASE_PACKAGES}) from {debian_mirror()} ...")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", DEBIAN_SUITE,
                        str(rootfs), debian_mirror()], check=True, capture_output=True)
        # Trim what a sandbox never needs: apt lists, docs, locales.
        for sub in ("var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale", "var/cache/apt"):
            shutil.rmtree(rootfs / sub, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap rootfs failed")


def ensure_image(log=print) -> str:
    """Tag of the sandbox image, building the base and sandbox layers when missing."""
    client = ensure_engine()
    tag = sandbox_tag()
    if _has_image(client, tag):
        return tag
    if not _has_image(client, base_tag()):
        _build_base(base_tag(), log)
    with tempfile.TemporaryDirectory(prefix="trace-rl-image-") as tmp:
        for name, data in _recipe_files().items():
            (Path(tmp) / name).write_bytes(data)
        df = Path(tmp) / "Dockerfile"
        df.write_text(df.read_text().replace("${BASE}", base_tag()))
        log(f"docker build {tag} ...")
        client.images.build(path=tmp, tag=tag, rm=True, network_mode="none")
    return tag
