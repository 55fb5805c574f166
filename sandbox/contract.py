"""The environment contract checked on the host: what a module's reset/step/reward/solve
return is validated here, so a module that returns the wrong types, NaN or a reward of 5.0
is a typed `SandboxError(kind="contract")` naming the call, never a TypeError in the caller.

Every caller (verifier, calibration, held-out episodes, GRPO) goes through these four."""
from __future__ import annotations

from trace_rl.core.reward import SUCCESS_THRESHOLD, check_unit, is_success
from trace_rl.sandbox.session import Sandbox, SandboxError


def _bad(call: str, message: str) -> SandboxError:
    return SandboxError("contract", f"{call}: {message}")


def _messages(msgs, call: str) -> list[dict]:
    if not isinstance(msgs, list):
        raise _bad(call, f"messages must be a list, got {type(msgs).__name__}")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content", ""), (str, type(None))):
            raise _bad(call, f"each message must be {{'role': str, 'content': str}}, got {str(m)[:120]}")
    return msgs


def reset(session: Sandbox, seed: int) -> dict:
    obs = session.call("reset", seed)
    call = f"reset({seed})"
    if not isinstance(obs, dict):
        raise _bad(call, f"must return a dict, got {type(obs).__name__}")
    if missing := {"system_prompt", "tools", "messages"} - set(obs):
        raise _bad(call, f"result lacks {sorted(missing)}")
    if not isinstance(obs["system_prompt"], str):
        raise _bad(call, f"system_prompt must be a string, got {type(obs['system_prompt']).__name__}")
    tools = obs["tools"]
    if not isinstance(tools, list) or not tools or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise _bad(call, "tools must be a non-empty list of {'type': 'function', 'function': {'name': ..., "
                         "'parameters': {...}}} schemas")
    msgs = _messages(obs["messages"], call)
    if not msgs or msgs[0].get("role") != "user":
        raise _bad(call, "messages must start with a user turn")
    if not isinstance(obs.get("hint", ""), (str, type(None))):
        raise _bad(call, "hint must be a string")
    steps = obs.get("max_steps", 12)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
        raise _bad(call, f"max_steps must be an integer in 1..1000, got {steps!r:.40}")
    return obs


def step(session: Sandbox, action: dict) -> dict:
    out = session.call("step", action)
    if not isinstance(out, dict) or not isinstance(out.get("done"), bool):
        raise _bad("step", f"must return {{'messages': [...], 'done': bool}}, got {str(out)[:120]}")
    _messages(out.get("messages"), "step")
    return out


def reward(session: Sandbox) -> dict:
    r = session.call("reward")
    if not isinstance(r, dict):
        raise _bad("reward", f"must return a dict, got {type(r).__name__}")
    try:  # finite numbers in [0, 1] (a bool reward refused), as core/reward.py checks them
        value = check_unit(r.get("reward"))
        comps = r.get("components", {})
        if not isinstance(comps, dict):
            raise _bad("reward", "components must be a dict of name -> value in [0, 1]")
        comps = {str(k): check_unit(float(v) if isinstance(v, bool) else v, f"component {k!r}")
                 for k, v in comps.items()}  # a bool component (called: True) is 1.0 / 0.0
    except ValueError as err:
        raise _bad("reward", str(err)) from None
    if not isinstance(r.get("success"), bool):
        raise _bad("reward", f"success must be true or false, got {r.get('success')!r:.40}")
    if r["success"] != is_success(value):  # one success rule for episodes and calibration alike
        raise _bad("reward", f"success={r['success']} disagrees with reward {value:.3f} (success means reward >= "
                             f"{SUCCESS_THRESHOLD}); do not override Environment.reward()")
    return {"reward": value, "components": comps, "success": r["success"]}


def solve(session: Sandbox) -> list[dict]:
    actions = session.call("solve")
    if not isinstance(actions, list) or not actions or not all(isinstance(a, dict) for a in actions):
        raise _bad("solve", "must return a non-empty list of actions ({'content': ...} or {'tool_calls': [...]})")
    return actions
