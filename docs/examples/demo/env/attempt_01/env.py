from trace_env import Environment

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
        created = NOW - datetime.fromisoformat(res["created_at"]) <= timedelta(hours=24)
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
                "created_at": created.strftime("%Y-%m-%dT%H:%M:%S"), "last_extension_date": null, "goodwill_credit_used_this_year": 25.0}
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
