"""Shared by every test folder (tests/<package folder>/ mirrors the package): the doubles, tiny models and
env modules in tests/support/ are importable here and in the processes tests start."""
import os
import sys
from pathlib import Path

import pytest

from trace_rl.core.io import cache_dir

SUPPORT = str(Path(__file__).resolve().parent / "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# the servers tests start keep their prompt states apart from the user's (which tests never write or prune),
# in a folder that outlives the session: a second test run restores τ²'s long prompt instead of reading it again
os.environ.setdefault("TRACE_RL_PROMPT_STATES", str(cache_dir() / "prompt-states-tests"))


def _docker_ok() -> bool:
    from trace_rl.sandbox.engine import engine_ok

    return engine_ok()


@pytest.fixture(scope="session")
def sandbox_image():
    """The real sandbox image (setup builds it; this only checks it is there)."""
    from trace_rl.sandbox.engine import ensure_image

    if not _docker_ok() and os.geteuid() != 0:
        pytest.skip("no Docker engine and not root")
    return ensure_image(log=lambda *a: None)


@pytest.fixture(scope="session")
def qwen05_server():
    """One llama.cpp server for the embedded Qwen2.5-Coder-0.5B for the whole session."""
    from trace_rl.models.llama_server import LlamaServer

    with LlamaServer("qwen2.5-coder-0.5b", n_ctx=4096) as srv:
        yield srv
