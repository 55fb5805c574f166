"""The spec runtime (sandbox/image/spec_env.py) as the sandbox sees it, loaded on the host, and the two
helpers that play episodes on it (the spec runtime's tests and pattern mode's share them)."""
import importlib.util
import sys

from paths import ROOT

IMAGE = ROOT / "sandbox" / "image"


def load_runtime():
    """spec_env and trace_env as the sandbox sees them: sibling modules on the path."""
    try:  # trace_env imports `reward`, which the image ships next to it (core/reward.py)
        from trace_rl.core import reward
        sys.modules.setdefault("reward", reward)
    except ImportError:
        pass
    if str(IMAGE) not in sys.path:
        sys.path.insert(0, str(IMAGE))
    import spec_env

    spec = importlib.util.spec_from_file_location("airline_reference_env",
                                                  ROOT / "sandbox" / "envs" / "precondition_verification_airline.py")
    airline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(airline)
    return spec_env, airline


def play(env, seed, actions):
    """One episode from reset(seed): actions is a list, or a function of the env (after reset)."""
    env.reset(seed)
    for action in actions(env) if callable(actions) else actions:
        if env.done:
            break
        env.step(action)
    if not env.done:
        env.step({"content": "Done."})
    return env.reward()


def call(name, **args):
    return {"tool_calls": [{"id": "c", "name": name, "arguments": args}]}
