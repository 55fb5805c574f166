# step() returns a message nested 100,000 deep
class Env(Env):
    def step(self, action):
        out = super().step(action)
        deep = []
        for _ in range(100_000):
            deep = [deep]
        out["messages"] = [{"role": "tool", "content": deep}]
        return out
