"""Where `rollout()` plays its episodes: `local` (threads in this process, the default) or `ray` (each episode a
Ray task on a node that offers a `sandbox` resource; results come back here, and this process alone writes the
store).

Under `ray` a node builds the benchmark once per worker process (from how `load_benchmark` built it, else from a
pickled copy) and plays episodes with its own sandbox sessions; the policy goes along pickled (an `LLM` is a client
of endpoints: its requests go to `base_url`, one or several). An episode whose node or worker is lost is run again
elsewhere, at most `retries` times, then recorded as `infra_error` (a later run of the same rollout plays it again).
Ray is imported here only, and only when asked for (`pip install trace-rl[ray]`).
"""
from __future__ import annotations

import importlib
import os
import uuid
from typing import Iterable, Iterator

from trace_rl.agents.base_agent import run_episode
from trace_rl.core.trajectory import Trajectory
from trace_rl.models.llm import LLM

EXECUTORS = ("local", "ray")
INFRA_ERROR = "infra_error"  # the episode's node (or worker) was lost more often than it may be retried
RESOURCE = "sandbox"  # what a node offers (`ray start --resources='{"sandbox": N}'`): N episodes at once
_MADE: dict[str, tuple] = {}  # on a node's worker: each rollout's (benchmark, policy), made once per process
_REMOTE = None  # the Ray task, made on first use


def _made(token: str, box: list) -> tuple:
    if token not in _MADE:
        import ray

        from trace_rl.evals.benchmark import load_benchmark

        what = ray.get(box[0])
        if "source" in what:  # as load_benchmark built it on the driver
            spec, options, offer, registered_in = what["source"]
            if registered_in:
                importlib.import_module(registered_in)
            bench = load_benchmark(spec, options, offer)
        else:
            bench = what["bench"]
        while len(_MADE) >= 4:  # an earlier rollout's benchmark: let it go (a worker benchmark ends its process)
            old = _MADE.pop(next(iter(_MADE)))[0]
            getattr(old, "close", lambda: None)()
        _MADE[token] = (bench, what["policy"])
    return _MADE[token]


def _play(token: str, box: list, tid: str, k: int, name: str, split: str, chat_kw: dict) -> Trajectory:
    """One episode, on a node (`box` holds an object ref, so Ray does not fetch it for every episode)."""
    bench, policy = _made(token, box)
    return run_episode(policy, lambda: bench.episode(tid), task_id=tid, benchmark=name, trial=k, split=split,
                       **chat_kw)


def connect(address: str | None = None):
    """The `ray` module, connected to the cluster at `address`, else $RAY_ADDRESS, else one started on this machine
    (`ray start --head`); a cluster where no node offers a `sandbox` resource is an error, not a hang."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("executor=ray needs Ray: pip install 'trace-rl[ray]'") from None
    if not ray.is_initialized():
        where = address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=where, logging_level="WARNING", log_to_driver=False)
        except ConnectionError as err:
            raise RuntimeError(f"executor=ray: no Ray cluster at {where!r} ({err}); start one (`ray start --head`, "
                               "docs/scale.md) or give its address (ray_address, $RAY_ADDRESS)") from None
    if ray.cluster_resources().get(RESOURCE, 0) < 1:
        raise RuntimeError(f"no node of the Ray cluster offers a {RESOURCE!r} resource: start each worker with "
                           f"`ray start --address=HEAD:6379 --resources='{{\"{RESOURCE}\": N}}'` (docs/scale.md)")
    return ray


def ray_episodes(benchmark, policy, jobs: Iterable[tuple[str, int]], *, split: str = "", address: str | None = None,
                 retries: int = 3, **chat_kw) -> Iterator[Trajectory]:
    """Each (task id, trial) of `jobs` played as a Ray task needing one `sandbox`; yields the trajectories as
    they finish (each job exactly once). An episode's own error is raised here, as it is locally; stopping the
    iteration cancels the episodes not yet finished."""
    global _REMOTE
    ray = connect(address)
    if type(policy)._complete is LLM._complete and not policy.config.base_url:
        raise ValueError(f"executor=ray: the agent's model {policy.name!r} has no base_url; every node must reach "
                         "it at an endpoint (serve it, e.g. vLLM or `trace-rl serve`, and set base_url)")
    source = getattr(benchmark, "loaded_from", None)
    box = [ray.put({"policy": policy, **({"source": source} if source else {"bench": benchmark})})]
    token = uuid.uuid4().hex
    if _REMOTE is None:
        _REMOTE = ray.remote(_play)
    play = _REMOTE.options(num_cpus=0, resources={RESOURCE: 1}, max_retries=retries, retry_exceptions=False)
    pending = {play.remote(token, box, tid, k, benchmark.name, split, chat_kw): (tid, k) for tid, k in jobs}
    try:
        while pending:
            ray.wait(list(pending), num_returns=1, fetch_local=False)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)  # all that have finished
            for ref in ready:
                tid, k = pending.pop(ref)
                try:
                    traj = ray.get(ref)
                except ray.exceptions.RayTaskError as err:  # the episode's own code raised: as it would here
                    raise err.as_instanceof_cause() from None
                except ray.exceptions.RayError as err:  # its node or worker was lost on every try
                    traj = Trajectory(task_id=tid, benchmark=benchmark.name, trial=k, model=policy.name, messages=[],
                                      reward=0.0, passed=False, termination=INFRA_ERROR, split=split,
                                      reasons={"error": f"{type(err).__name__}: {str(err)[:1500]}",
                                               "error_kind": INFRA_ERROR, "tries": retries + 1})
                yield traj
    finally:
        for ref in pending:  # stopped: nothing more runs for this rollout
            ray.cancel(ref, force=True)
