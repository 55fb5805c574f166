# writes 50 MB with no newline to the protocol channel: cut at the reply cap
class Env(Env):
    def generate(self, rng):
        protocol_write(b"[" * (50 << 20))
        return super().generate(rng)
