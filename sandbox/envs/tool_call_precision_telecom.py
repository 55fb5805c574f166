"""Reference environment: tool-calling precision on τ²-bench telecom's own tools (solo mode).

Capability: tool_call_precision — call the tool the task needs with exactly the arguments its
schema allows (these take none), and nothing invented. The embedded 0.5B agent's telecom
trajectories fail this way: it fills argument-less tools with made-up "properties". The ticket
names one phone check (status bar, network status, data restrictions, speed test); the agent
runs it and closes the ticket with `done`.
Reward (denser than the target's all-or-nothing, as TRACE §3 asks): 0.2 the first call names the
right check + 0.3 with valid arguments + 0.2 no invalid or wrong calls (given at least one call) +
0.3 closed with `done` right after. The first part is what a small base model gets some of the time
(the right tool, invented arguments), so its GRPO groups carry signal from the start.
"""
from trace_env import Environment

INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
You will be provided with a ticket that contains the user's request.
You will need to plan and call the appropriate tools to solve the ticket.

You cannot communicate with the user, only make tool calls.
Stop when you consider that you have solved the ticket.
To do so, send a message containing a single tool call to the `done` tool. Do not include any other tool calls in this last message.

Always follow the policy. Always make sure you generate valid JSON only."""

POLICY = """# Telecom Agent Policy (technical support excerpt)
The tools in this ticket act on the user's phone. Call a tool with exactly the arguments its schema lists."""

NAMES = ["John Smith", "Ana Lopez", "Wei Chen", "Priya Nair", "Omar Haddad", "Lena Novak", "Sam Taylor", "Yuki Sato"]
ASKS = {
    "check_status_bar": ["see which icons their status bar shows", "know what the top of their screen shows"],
    "check_network_status": ["know whether they are connected to the cellular network",
                             "check their airplane mode and mobile data settings"],
    "check_data_restriction_status": ["know whether Data Saver is limiting them", "check for data-limiting features"],
    "run_speed_test": ["know how fast their internet connection is", "measure their download speed"],
}
RESULTS = {
    "check_status_bar": "Status Bar: 📶³ Good | 4G | 📱 Data Enabled | 🔋 {battery}%",
    "check_network_status": "Airplane Mode: OFF\nSIM Card Status: active\nCellular Connection: connected\n"
                            "Cellular Signal: good\nCellular Network Type: 4G\nMobile Data Enabled: Yes\n"
                            "Data Roaming Enabled: No\nWi-Fi Radio: OFF\nWi-Fi Connected: No",
    "check_data_restriction_status": "Data Saver mode is OFF.",
    "run_speed_test": "Speed Test Result: 86.40 Mbps (Excellent). Connection is very fast.",
}


def _tool(name, description):
    """One of telecom's tools (they take no arguments), as its schema reads."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "properties": {}, "title": "parameters", "type": "object"}}}


TOOLS = [
    _tool("check_network_status",
          "Checks your phone's connection status to cellular networks and Wi-Fi. Shows airplane mode status, "
          "signal strength, network type, whether mobile data is enabled, and whether data roaming is enabled."),
    _tool("check_status_bar",
          "Shows what icons are currently visible in your phone's status bar (the area at the top of the "
          "screen). Displays network signal strength, mobile data status (enabled, disabled, data saver), "
          "Wi-Fi status, and battery level."),
    _tool("run_speed_test",
          "Measures your current internet connection speed (download speed). Provides information about "
          "connection quality and what activities it can support."),
    _tool("check_data_restriction_status",
          "Checks if your phone has any data-limiting features active. Shows if Data Saver mode is on."),
    {"type": "function", "function": {
        "name": "done", "description": "Call this when the ticket is solved. Call no other tool in the same turn.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]


class Env(Environment):
    max_steps = 4
    tools = TOOLS
    hint = "Every tool here takes no arguments: call it with an empty arguments object."

    def generate(self, rng):
        self.name = rng.choice(NAMES)
        self.phone = f"555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
        self.tool = rng.choice(sorted(ASKS))
        self.ask = rng.choice(ASKS[self.tool])
        self.battery = rng.randint(20, 95)
        self.ended_with_done = False
        self.invalid = 0
        return "Solve the ticket in the system prompt."

    @property
    def system_prompt(self):
        ticket = (f"Customer name: {self.name}, phone number: {self.phone}. The user wants to {self.ask}. "
                  "Run that one check on their phone, then close the ticket.")
        return (f"<instructions>\n{INSTRUCTION}\n</instructions>\n<policy>\n{POLICY}\n</policy>\n"
                f"<ticket>\n{ticket}\n</ticket>")

    def _check(self, name, args):
        if args:  # these tools take no arguments: telecom's tools reject unknown ones
            self.invalid += 1
            raise TypeError(f"{name}() got unexpected keyword arguments: {', '.join(sorted(args))}")
        return RESULTS[name].format(battery=self.battery)

    def tool_check_status_bar(self, **args):
        return self._check("check_status_bar", args)

    def tool_check_network_status(self, **args):
        return self._check("check_network_status", args)

    def tool_check_data_restriction_status(self, **args):
        return self._check("check_data_restriction_status", args)

    def tool_run_speed_test(self, **args):
        return self._check("run_speed_test", args)

    def tool_done(self, **args):
        if args:
            self.invalid += 1
            raise TypeError(f"done() got unexpected keyword arguments: {', '.join(sorted(args))}")
        self.ended_with_done = True
        self.done = True
        return "Ticket closed."

    # -- reward
    def score(self):
        w = {"right_tool": 0.2, "right_call": 0.3, "clean": 0.2, "closed": 0.3}
        first = self.calls[0] if self.calls else None  # precision: the first call is the right one, not a guess
        named = bool(first) and first[0] == self.tool
        ok = [first] if named and first[2] is not None else []
        wrong = [c for c in self.calls if c[0] not in (self.tool, "done")]
        closed_after = bool(ok) and self.ended_with_done and self.calls[-1][0] == "done"
        clean = bool(self.calls) and not self.invalid and not wrong
        return {"components": {"right_tool": float(named), "right_call": float(bool(ok)), "clean": float(clean),
                               "closed": float(closed_after)},
                "weights": w}

    def reference_actions(self):
        return [{"tool_calls": [{"id": "r0", "name": self.tool, "arguments": {}}]},
                {"tool_calls": [{"id": "r1", "name": "done", "arguments": {}}]}]
