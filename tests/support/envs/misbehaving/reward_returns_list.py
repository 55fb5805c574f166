# reward() returns a list
class Env(Env):
    def reward(self):
        return [1.0]
