"""Reference environment: mobile-data troubleshooting on τ²-bench telecom's own tools (solo mode).

Capability: stateful diagnosis — look at the device's state before changing it, fix exactly
the faults that are there (one or two, seeded: airplane mode on, mobile data off, data saver
on, roaming off while abroad), leave what works alone, and confirm the fix before calling
`done`. As in telecom's solo mode, the ticket is in the system prompt, the agent may only
call tools, and an episode that does not end with `done` scores 0.
Reward: 0.6 fixed (the final state works, nothing else broken) + 0.2 diagnosed (a status
check before the first change) + 0.2 verified (a check after the last change, on a fixed phone).
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
The tools in this ticket act on the user's phone.
## Mobile data issues
Mobile data needs: Airplane Mode OFF, Mobile Data enabled, and Data Roaming enabled when the user is abroad.
Data Saver mode limits speed; it must be OFF for an excellent speed test.
Check the phone's status before changing any setting, change only what is wrong (every toggle flips a setting),
and confirm with a speed test or a status check before you finish."""

NAMES = ["John Smith", "Ana Lopez", "Wei Chen", "Priya Nair", "Omar Haddad", "Lena Novak", "Sam Taylor", "Yuki Sato"]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Italy", "Kenya"]
FAULTS = ["airplane_mode_on", "data_mode_off", "data_saver_mode_on", "roaming_off_abroad"]
CHECKS = ("check_network_status", "check_status_bar", "run_speed_test")


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
    _tool("toggle_airplane_mode",
          "Toggles Airplane Mode ON or OFF. When ON, it disconnects all wireless communications including "
          "cellular, Wi-Fi, and Bluetooth.\n\nReturns the new state of airplane_mode."),
    _tool("toggle_data",
          "Toggles your phone's mobile data connection ON or OFF. Controls whether your phone can use cellular "
          "data for internet access when Wi-Fi is unavailable.\n\nReturns the new data connection status."),
    _tool("toggle_data_saver_mode",
          "Toggles Data Saver mode ON or OFF. When ON, it reduces data usage, which may affect data "
          "speed.\n\nReturns the new data saver mode status."),
    _tool("toggle_roaming",
          "Toggles Data Roaming ON or OFF. When ON, your phone can use data networks in areas outside your "
          "carrier's coverage.\n\nReturns the new data roaming status."),
    {"type": "function", "function": {
        "name": "done", "description": "Call this when the ticket is solved. Call no other tool in the same turn.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]


class Env(Environment):
    max_steps = 10
    tools = TOOLS
    hint = ("Look at the phone's network status first; for each setting that blocks or slows mobile data, "
            "flip it once; run a speed test to confirm before calling done.")

    def generate(self, rng):
        self.name = rng.choice(NAMES)
        self.phone = f"555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
        self.abroad = rng.random() < 0.5
        self.country = rng.choice(COUNTRIES)
        faults = [f for f in FAULTS if f != "roaming_off_abroad" or self.abroad]
        self.faults = sorted(rng.sample(faults, rng.choice([1, 1, 2])))
        self.airplane = "airplane_mode_on" in self.faults
        self.data = "data_mode_off" not in self.faults
        self.saver = "data_saver_mode_on" in self.faults
        # roaming is on unless it is the fault; at home it does not matter, so it may be either
        self.roaming = "roaming_off_abroad" not in self.faults and (self.abroad or rng.random() < 0.5)
        self.battery = rng.randint(20, 95)
        self.ended_with_done = False
        return "Solve the ticket in the system prompt."

    @property
    def system_prompt(self):
        where = f"abroad in {self.country}" if self.abroad else "at home"
        ticket = (f"The user is experiencing issues with their mobile data: pages do not load or load very slowly. "
                  f"Customer name: {self.name}, phone number: {self.phone}, current location: {where}. "
                  "They will consider the issue resolved when speed test returns excellent internet speed.")
        return (f"<instructions>\n{INSTRUCTION}\n</instructions>\n<policy>\n{POLICY}\n</policy>\n"
                f"<ticket>\n{ticket}\n</ticket>")

    # -- device model (telecom's formats)
    def _connected(self):
        return not self.airplane and self.data and (self.roaming or not self.abroad)

    def _status_bar(self):
        if self.airplane:
            return f"✈️ Airplane Mode | 🔋 {self.battery}%"
        parts = ["📶³ Good", "4G"]
        if self.data and self._connected():
            parts.append("📱 Data Enabled")
            if self.saver:
                parts.append("🔽 Data Saver")
        else:
            parts.append("📵 Data Disabled")
        return " | ".join(parts + [f"🔋 {self.battery}%"])

    def tool_check_status_bar(self):
        return f"Status Bar: {self._status_bar()}"

    def tool_check_network_status(self):
        on = not self.airplane
        return "\n".join([
            f"Airplane Mode: {'ON' if self.airplane else 'OFF'}", "SIM Card Status: active",
            f"Cellular Connection: {'connected' if on else 'no_service'}",
            f"Cellular Signal: {'good' if on else 'none'}", f"Cellular Network Type: {'4G' if on else 'none'}",
            f"Mobile Data Enabled: {'Yes' if self.data else 'No'}",
            f"Data Roaming Enabled: {'Yes' if self.roaming else 'No'}", "Wi-Fi Radio: OFF", "Wi-Fi Connected: No"])

    def tool_run_speed_test(self):
        if not self._connected():
            return "Speed test failed: No cellular data connection."
        if self.saver:
            return "Speed Test Result: 1.20 Mbps (Poor). Connection is slow. Web browsing may be sluggish, streaming difficult."
        return "Speed Test Result: 86.40 Mbps (Excellent). Connection is very fast."

    def _toggled(self, label, value):
        return f"{label} is now {'ON' if value else 'OFF'}.\nStatus Bar: {self._status_bar()}"

    def tool_toggle_airplane_mode(self):
        self.airplane = not self.airplane
        return self._toggled("Airplane Mode", self.airplane)

    def tool_toggle_data(self):
        self.data = not self.data
        return self._toggled("Mobile Data", self.data)

    def tool_toggle_data_saver_mode(self):
        self.saver = not self.saver
        return self._toggled("Data Saver Mode", self.saver)

    def tool_toggle_roaming(self):
        self.roaming = not self.roaming
        return self._toggled("Data Roaming", self.roaming)

    def tool_done(self):
        self.ended_with_done = True
        self.done = True
        return "Ticket closed."

    # -- reward
    def score(self):
        if not self.ended_with_done:
            return {"components": {"fixed": 0.0, "diagnosed": 0.0, "verified": 0.0},
                    "weights": {"fixed": 0.6, "diagnosed": 0.2, "verified": 0.2}}
        names = [c[0] for c in self.calls]
        toggles = [i for i, n in enumerate(names) if n.startswith("toggle_")]
        checks = [i for i, n in enumerate(names) if n in CHECKS]
        fixed = self._connected() and not self.saver
        diagnosed = bool(checks) and (not toggles or checks[0] < toggles[0])
        verified = fixed and bool(checks) and (not toggles or checks[-1] > toggles[-1])
        return {"components": {"fixed": float(fixed), "diagnosed": float(diagnosed), "verified": float(verified)},
                "weights": {"fixed": 0.6, "diagnosed": 0.2, "verified": 0.2}}

    def reference_actions(self):
        call = lambda i, name: {"tool_calls": [{"id": f"r{i}", "name": name, "arguments": {}}]}
        fixes = {"airplane_mode_on": "toggle_airplane_mode", "data_mode_off": "toggle_data",
                 "data_saver_mode_on": "toggle_data_saver_mode", "roaming_off_abroad": "toggle_roaming"}
        acts = [call(0, "check_network_status")]
        acts += [call(i + 1, fixes[f]) for i, f in enumerate(self.faults)]
        return acts + [call(8, "run_speed_test"), call(9, "done")]
