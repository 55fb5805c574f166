"""A benchmark known by a registered name (as a run's `components` module registers its target): nothing else
imports this module, so a Ray node knows the name only if it imports the module that registered it."""
from ray_doubles import SlowLetters
from trace_rl.evals.benchmark import register

register("slow-letters", lambda variant, **kw: SlowLetters(**kw))
