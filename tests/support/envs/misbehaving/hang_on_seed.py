# reset(3) never returns: a timeout on that seed, the next seed on a fresh session
class Env(Env):
    def generate(self, rng):
        while self.seed == 3:
            pass
        return super().generate(rng)
