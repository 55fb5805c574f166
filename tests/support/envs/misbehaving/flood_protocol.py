# floods the protocol channel with garbage from a thread, forever
import threading


def _flood():
    while True:
        protocol_write(b"x" * 65536)


class Env(Env):
    def generate(self, rng):
        threading.Thread(target=_flood, daemon=True).start()
        return super().generate(rng)
