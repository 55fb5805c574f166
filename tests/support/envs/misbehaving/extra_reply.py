# sends one extra, valid-looking reply: the session is out of step and must be discarded
class Env(Env):
    def generate(self, rng):
        protocol_write(b'{"id": 999, "ok": true, "result": null}\n')
        return super().generate(rng)
