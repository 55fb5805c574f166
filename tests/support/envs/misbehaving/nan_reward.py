# reward() is NaN, and the module patches json.dumps so the runner would send it: the host refuses NaN
import json
import functools
_dumps = json.dumps
json.dumps = lambda obj, **kw: _dumps(obj, **{**kw, "allow_nan": True})


class Env(Env):
    def reward(self):
        return {"reward": float("nan"), "components": {}, "success": False}
