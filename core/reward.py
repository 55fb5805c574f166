"""One definition of an episode's reward (stdlib only: the sandbox image carries this file as
`reward.py` next to trace_env.py, so the same code scores inside the sandbox and checks on the host).

An environment's `score()` gives named components, each in [0, 1], and a non-negative weight per
component; the reward is their weighted mean, and an episode is a success when the reward reaches
SUCCESS_THRESHOLD. Anything else (a component of 5, NaN, a weight for no component, a negative
weight) is a ValueError naming the key, not a silently clamped number.
"""
import math

SUCCESS_THRESHOLD = 0.99


def check_unit(x, name="reward"):
    """x as a float when it is a finite number in [0, 1]; otherwise ValueError naming `name`.
    Bools are refused (True is not a reward: convert a flag with float() first)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a finite number in [0, 1], got {x!r:.80}")
    return float(x)


def aggregate(components, weights):
    """Weighted mean of `components` ({name: value in [0, 1]}, a bool counts as 1.0 / 0.0) under
    `weights` ({name: weight >= 0}). A component without a weight is kept out of the mean; a weight
    naming no component is an error. All weights zero (or none) gives 0.0."""
    if not isinstance(components, dict) or not isinstance(weights, dict):
        raise ValueError("components and weights must be dicts of name -> number")
    comps = {k: check_unit(float(v) if isinstance(v, bool) else v, f"component {k!r}") for k, v in components.items()}
    total = 0.0
    for k, w in weights.items():
        if k not in comps:
            raise ValueError(f"weight {k!r} names no component (components: {sorted(map(str, comps))[:20]})")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {k!r} must be a finite number >= 0, got {w!r:.80}")
        total += w
    if total <= 0:
        return 0.0
    value = sum(w * comps[k] for k, w in weights.items()) / total
    if not (math.isfinite(total) and math.isfinite(value)):  # weights whose sum overflows: x / inf, inf / inf
        raise ValueError(f"weights {sorted(map(str, weights))[:20]} overflow (their sum is {total!r}): scale them down")
    return min(1.0, max(0.0, value))  # only float rounding can leave [0, 1] here


def is_success(reward):
    return reward >= SUCCESS_THRESHOLD
