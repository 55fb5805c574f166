# the solver's reward is 5.0: out of range, caught on the host
class Env(Env):
    def reward(self):
        return {"reward": 5.0, "components": {"a": 5.0}, "success": True}
