"""A driver process for the Ray executor's crash test: connects to the cluster at argv[1] and rolls the slow
letters benchmark out into the store at argv[2] (argv[3] tasks, argv[4] s per step); the test kills it mid-way."""
import sys

import ray

from ray_doubles import SlowLetters, letters_agent
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.rollout import rollout

if __name__ == "__main__":
    address, out, n, delay = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    bench = SlowLetters(n, delay)
    rollout(bench, letters_agent(), [str(i) for i in range(n)], TrajectoryStore(out), trials=2, progress=False,
            executor="ray")
