"""Where the tests' shared parts are: this folder (doubles, tiny models, env modules) and the checkout."""
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
