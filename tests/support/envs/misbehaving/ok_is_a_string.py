# answers {"ok": "false"} itself: "false" is not a bool
class Env(Env):
    def generate(self, rng):
        protocol_write(b'{"id": 1, "ok": "false", "result": null}\n')
        return super().generate(rng)
