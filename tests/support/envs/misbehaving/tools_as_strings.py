# tools are names, not schemas: a contract error, not a TypeError in the verifier
class Env(Env):
    tools = ["get_user"]
