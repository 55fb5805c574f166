# the system prompt is an int
class Env(Env):
    @property
    def system_prompt(self):
        return 42
