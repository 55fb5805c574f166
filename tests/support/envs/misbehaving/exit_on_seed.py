# the process exits in reset(2): the container is gone (crashed), the next seed on a fresh session
class Env(Env):
    def generate(self, rng):
        if self.seed == 2:
            os._exit(3)
        return super().generate(rng)
