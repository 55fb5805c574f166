"""Reference environment: precondition verification on τ²-bench airline's tools.

The user asks to cancel a reservation. The policy allows it only under conditions the
agent must check in the reservation first (nothing flown; booked within 24 h, business
cabin, airline-cancelled, or insured with a covered reason). The API does not check them.
Tools, argument types, return shapes and message format are airline's; the state is a
small seeded in-memory DB. Reward: 0.6 action (right decision, taken after looking the
reservation up) + 0.4 communication (the outcome told to the user, only once checked).
"""
from datetime import datetime, timedelta

from trace_env import Environment

NOW = datetime(2024, 5, 15, 15, 0, 0)  # airline's policy: "the current time is 2024-05-15 15:00:00 EST"
AIRPORTS = ["SFO", "JFK", "LAX", "ORD", "DFW", "DEN", "SEA", "ATL", "MIA", "BOS", "PHX", "LAS"]
FIRST = ["Chen", "Sara", "Raj", "Fatima", "Noah", "Mia", "Yusuf", "Lena", "Omar", "Ivy"]
LAST = ["Jackson", "Doe", "Smith", "Martin", "Kim", "Garcia", "Rossi", "Novak", "Ali", "Brown"]
REASONS = {"change_of_plan": "my plans changed", "health": "I'm sick and can't travel",
           "weather": "a storm is forecast", "airline_cancelled": "the airline cancelled my flight"}
REFUSE_WORDS = ("cannot", "can't", "can not", "unable", "not able", "not eligible", "isn't eligible", "not possible")

POLICY = """## Cancel flight
First, the agent must obtain the user id and reservation id.
The agent must also obtain the reason for cancellation (change of plan, airline cancelled flight, or other reasons).
If any portion of the flight has already been flown, the agent cannot help and transfer is needed.
Otherwise, flight can be cancelled if any of the following is true:
- The booking was made within the last 24 hrs
- The flight is cancelled by airline
- It is a business flight
- The user has travel insurance and the reason for cancellation is covered by insurance (health or weather).
The API does not check that cancellation rules are met, so the agent must make sure the rules apply before calling the API!
The current time is 2024-05-15 15:00:00 EST."""

INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user.
- Make a tool call.
You cannot do both at the same time.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only."""


def _param(name, title, desc):
    return {"properties": {name: {"description": desc, "title": title, "type": "string"}},
            "required": [name], "title": "parameters", "type": "object"}


TOOLS = [
    {"type": "function", "function": {"name": "cancel_reservation", "description": "Cancel the whole reservation.",
     "parameters": _param("reservation_id", "Reservation Id", "The reservation ID, such as 'ZFA04Y'.")}},
    {"type": "function", "function": {"name": "get_reservation_details", "description": "Get the details of a reservation.",
     "parameters": _param("reservation_id", "Reservation Id", "The reservation ID, such as '8JX2WO'.")}},
    {"type": "function", "function": {"name": "get_user_details",
     "description": "Get the details of a user, including their reservations.",
     "parameters": _param("user_id", "User Id", "The user ID, such as 'sara_doe_496'.")}},
    {"type": "function", "function": {"name": "transfer_to_human_agents", "description":
     "Transfer the user to a human agent, with a summary of the user's issue.\n\nOnly transfer if\n -  the user "
     "explicitly asks for a human agent\n -  given the policy and the available tools, you cannot solve the user's issue.",
     "parameters": _param("summary", "Summary", "A summary of the user's issue.")}},
]


class Env(Environment):
    max_steps = 10
    tools = TOOLS
    hint = ("Before changing anything, look the reservation up and check each cancellation rule of the policy "
            "against what you find; tell the user the outcome and why.")

    def generate(self, rng):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        self.user_id = f"{first.lower()}_{last.lower()}_{rng.randint(100, 9999)}"
        self.reservations = {}
        for _ in range(rng.randint(1, 3)):
            rid = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(6))
            self.reservations[rid] = self._reservation(rng, rid, first, last)
        self.rid = rng.choice(sorted(self.reservations))
        res = self.reservations[self.rid]
        self.reason = rng.choice(sorted(REASONS))
        self.flown = res["flights"][0]["date"] < NOW.strftime("%Y-%m-%d")
        recent = NOW - datetime.fromisoformat(res["created_at"]) <= timedelta(hours=24)
        insured_ok = res["insurance"] == "yes" and self.reason in ("health", "weather")
        self.eligible = not self.flown and (recent or res["cabin"] == "business"
                                            or self.reason == "airline_cancelled" or insured_ok)
        return (f"Hi, my user id is {self.user_id}. I'd like to cancel reservation {self.rid} because "
                f"{REASONS[self.reason]}.")

    def _reservation(self, rng, rid, first, last):
        o, d = rng.sample(AIRPORTS, 2)
        # a third of the trips already started (flown), the rest are in the future
        start = NOW + timedelta(days=rng.choice([-3, -1, 2, 5, 9, 14, 20]))
        created = NOW - timedelta(hours=rng.choice([3, 12, 20, 30, 72, 240, 500]))
        flight_type = rng.choice(["one_way", "round_trip"])
        flights = [{"origin": o, "destination": d, "flight_number": f"HAT{rng.randint(1, 299):03d}",
                    "date": start.strftime("%Y-%m-%d"), "price": rng.randint(60, 900)}]
        if flight_type == "round_trip":
            flights.append({"origin": d, "destination": o, "flight_number": f"HAT{rng.randint(1, 299):03d}",
                            "date": (start + timedelta(days=rng.randint(2, 7))).strftime("%Y-%m-%d"),
                            "price": rng.randint(60, 900)})
        n = rng.randint(1, 3)
        total = sum(f["price"] for f in flights) * n
        return {"reservation_id": rid, "user_id": self.user_id, "origin": o, "destination": d,
                "flight_type": flight_type, "cabin": rng.choice(["basic_economy", "economy", "business"]),
                "flights": flights,
                "passengers": [{"first_name": first if i == 0 else rng.choice(FIRST), "last_name": last,
                                "dob": f"19{rng.randint(50, 99)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}"}
                               for i in range(n)],
                "payment_history": [{"payment_id": f"credit_card_{rng.randint(1000000, 9999999)}", "amount": total}],
                "created_at": created.strftime("%Y-%m-%dT%H:%M:%S"), "total_baggages": rng.randint(0, 3),
                "nonfree_baggages": 0, "insurance": rng.choice(["yes", "no"]), "status": None}

    @property
    def system_prompt(self):
        return f"<instructions>\n{INSTRUCTION}\n</instructions>\n<policy>\n{POLICY}\n</policy>"

    # -- tools (airline's names, arguments and return shapes)
    def tool_get_user_details(self, user_id):
        if user_id != self.user_id:
            raise ValueError(f"User {user_id} not found")
        first, last = self.user_id.split("_")[:2]
        return {"user_id": self.user_id, "name": {"first_name": first.title(), "last_name": last.title()},
                "address": {"address1": "1 Main St", "address2": "", "city": "Austin", "country": "USA",
                            "state": "TX", "zip": "78701"},
                "email": f"{first}.{last}@example.com", "dob": "1980-01-01", "payment_methods": {},
                "saved_passengers": [], "membership": "regular", "reservations": sorted(self.reservations)}

    def tool_get_reservation_details(self, reservation_id):
        if reservation_id not in self.reservations:
            raise ValueError(f"Reservation {reservation_id} not found")
        return self.reservations[reservation_id]

    def tool_cancel_reservation(self, reservation_id):
        res = self.tool_get_reservation_details(reservation_id)
        res["payment_history"] = res["payment_history"] + [
            {"payment_id": p["payment_id"], "amount": -p["amount"]} for p in res["payment_history"]]
        res["status"] = "cancelled"
        return res

    def tool_transfer_to_human_agents(self, summary):
        return "Transfer successful"

    # -- reward
    def score(self):
        looked_up = [i for i, c in enumerate(self.calls)
                     if c[0] == "get_reservation_details" and c[1].get("reservation_id") == self.rid and c[2]]
        cancels = [i for i, c in enumerate(self.calls) if c[0] == "cancel_reservation" and c[2]]
        target_cancelled = self.reservations[self.rid]["status"] == "cancelled"
        others_cancelled = any(r["status"] == "cancelled" for k, r in self.reservations.items() if k != self.rid)
        checked_first = bool(looked_up) and (not cancels or looked_up[0] < cancels[0])
        transferred = bool(self.called("transfer_to_human_agents"))
        if self.eligible:
            right = target_cancelled and not others_cancelled
        elif self.flown:
            right = not target_cancelled and not others_cancelled and transferred
        else:
            right = not target_cancelled and not others_cancelled
        action = float(right and checked_first)
        reply = self.final_reply.lower()
        if self.eligible:
            told = "cancel" in reply and not any(w in reply for w in REFUSE_WORDS)
        else:
            told = any(w in reply for w in REFUSE_WORDS) or (self.flown and transferred)
        communication = float(told and bool(looked_up))
        return {"components": {"action": action, "communication": communication},
                "weights": {"action": 0.6, "communication": 0.4}}

    def reference_actions(self):
        acts = [{"tool_calls": [{"id": "r1", "name": "get_reservation_details",
                                 "arguments": {"reservation_id": self.rid}}]}]
        if self.flown:
            acts.append({"tool_calls": [{"id": "r2", "name": "transfer_to_human_agents",
                                         "arguments": {"summary": f"User wants to cancel {self.rid}; part already flown."}}]})
            acts.append({"content": "Part of this trip has already been flown, so I cannot cancel it; "
                                    "I have transferred you to a human agent."})
        elif self.eligible:
            acts.append({"tool_calls": [{"id": "r2", "name": "cancel_reservation",
                                         "arguments": {"reservation_id": self.rid}}]})
            acts.append({"content": f"Reservation {self.rid} is now cancelled; the refund goes back to your payment method."})
        else:
            acts.append({"content": f"I'm sorry, reservation {self.rid} is not eligible for cancellation under our "
                                    "policy, so I cannot cancel it."})
        return acts
