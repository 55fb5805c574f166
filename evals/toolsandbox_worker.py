"""ToolSandbox's side of the `toolsandbox` benchmark: runs in ToolSandbox's own venv (imports only
`tool_sandbox` and the standard library) behind `worker_main.py`; `evals/toolsandbox.py` is the
trace-rl side, and docs/benchmarks.md ("Built-in: ToolSandbox") says what is played and how.

An episode plays one scenario the way ToolSandbox's `Scenario.play` does, with trace-rl's agent
in the agent's seat: ToolSandbox's `ExecutionEnvironment` executes the agent's tool calls,
ToolSandbox's converters make its messages and tool schemas, and ToolSandbox's `Evaluation`
scores the finished context (milestone / minefield similarity).

Model-written text never reaches exec: ToolSandbox's environment runs Python source, so a tool
call is executed only when its name is one the scenario offers the agent, and its arguments are
a JSON object; the source it runs is made by ToolSandbox's own `openai_tool_call_to_python_code`
from the offered name, an id made here (`tsb_call_N`) and the *decoded* arguments, which it writes
as their Python repr: literals only (str, int, float, bool, None, list, dict; non-finite numbers
are refused). Any other call is not executed: it gets an error tool message in the shape of
ToolSandbox's own execution errors.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import random

from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
from tool_sandbox.common.execution_context import (DatabaseNamespace, RoleType, ScenarioCategories,
                                                   get_current_context, set_current_context)
from tool_sandbox.common.message_conversion import Message, openai_tool_call_to_python_code, to_openai_messages
from tool_sandbox.common.tool_conversion import convert_to_openai_tool, convert_to_openai_tools
from tool_sandbox.common.tool_discovery import ToolBackend
from tool_sandbox.roles.base_role import BaseRole
from tool_sandbox.roles.execution_environment import ExecutionEnvironment
from tool_sandbox.roles.openai_api_user import OpenAIAPIUser
from tool_sandbox.scenarios import named_scenarios
from tool_sandbox.scenarios.user_simulator_few_shot_examples import USER_INSTRUCTION

RAPID_API_MODULE = "tool_sandbox.tools.rapid_api_search_tools"  # its tools call RapidAPI: internet + RAPID_API_KEY
AUGMENTATIONS = {ScenarioCategories.NO_DISTRACTION_TOOLS, ScenarioCategories.THREE_DISTRACTION_TOOLS,
                 ScenarioCategories.TEN_DISTRACTION_TOOLS, ScenarioCategories.ALL_TOOLS_AVAILABLE,
                 ScenarioCategories.TOOL_NAME_SCRAMBLED, ScenarioCategories.TOOL_DESCRIPTION_SCRAMBLED,
                 ScenarioCategories.ARG_DESCRIPTION_SCRAMBLED, ScenarioCategories.ARG_TYPE_SCRAMBLED,
                 ScenarioCategories.ARG_NAME_SCRAMBLED}
# Name endings that make a variant of another scenario (rephrased, another device state, held-back
# information, more user turns): stripped repeatedly, what is left names the family.
VARIANT_MARKERS = ("alt", "implicit", "multiple_user_turn", "insufficient_information", "low_battery_mode",
                   "wifi_off", "cellular_off", "ambiguous", "twice", "canonicalize", "no_remove_contact",
                   "no_search_contacts", "and_location")
REPHRASED = ("_alt", "_implicit")  # the same task in other words: not a base scenario
MAX_PARALLEL = 5  # ToolSandbox runs parallel calls in every order (n! runs); more than this are refused
SEED = 42  # ToolSandbox's CLI seeds `random` so before building its scenarios (it shuffles tool lists)


def family(name: str) -> str:
    """The scenario a variant belongs to: `turn_on_wifi_low_battery_mode_implicit` -> `turn_on_wifi`."""
    stem, changed = name, True
    while changed:
        changed = False
        for marker in VARIANT_MARKERS:
            if stem.endswith("_" + marker) and len(stem) > len(marker) + 1:
                stem, changed = stem[: -len(marker) - 1], True
    return stem


def split_of(name: str) -> str:
    """train or test, from the family's name alone: a new scenario moves no other, and every
    variant of a scenario lands where the scenario does."""
    return ("train", "test")[int(hashlib.sha256(family(name).encode()).hexdigest(), 16) % 2]


def decode_arguments(raw) -> dict | None:
    """A tool call's arguments as Python values, or None when they are not one finite JSON object."""
    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError("non-finite number")
        return value

    def refuse(text: str):
        raise ValueError(f"{text} is not JSON")

    try:
        args = json.loads(raw if isinstance(raw, str) and raw.strip() else "{}", parse_float=finite,
                          parse_constant=refuse)
    except (ValueError, RecursionError):
        return None
    return args if isinstance(args, dict) and "__malformed__" not in args else None


class _Agent(BaseRole):
    role_type = RoleType.AGENT


class _User(BaseRole):
    role_type = RoleType.USER


class ToolSandboxEpisode:
    max_steps = 30

    def __init__(self, name: str, scenario):
        self.name, self.scenario = name, scenario
        self.context, self.env, self.limit, self.error = None, ExecutionEnvironment(), 0, None
        self.calls = 0

    # the execution context is ToolSandbox's global: each request makes this episode's the current one
    def _enter(self):
        set_current_context(self.context)

    def _leave(self):
        self.context = get_current_context()  # parallel calls may have replaced it

    def _run(self, fn, *args):
        self._enter()
        try:
            return fn(*args)
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"[:2000]
            raise
        finally:
            self._leave()

    def _over(self) -> bool:
        """ToolSandbox's own limit: `scenario.max_messages` messages after the starting ones."""
        return get_current_context().max_sandbox_message_index >= self.limit

    @staticmethod
    def _count() -> int:
        return len(BaseRole.get_messages())

    @staticmethod
    def _since(count: int) -> list:
        return BaseRole.get_messages()[count:]

    def reset(self) -> dict:
        self.context = copy.deepcopy(self.scenario.starting_context)
        return self._run(self._reset)

    def _reset(self) -> dict:
        # as Scenario.play: the system's messages to the execution environment (the tool imports) first
        db = self.context.get_database(DatabaseNamespace.SANDBOX, drop_sandbox_message_index=False,
                                       get_all_history_snapshots=True)
        start = self.context.max_sandbox_message_index
        for i in range(start + 1):
            if db["recipient"][i] == RoleType.EXECUTION_ENVIRONMENT and db["sender"][i] == RoleType.SYSTEM:
                self.env.respond(ending_index=i)
        self.limit = start + self.scenario.max_messages
        seen, _ = to_openai_messages(_Agent.filter_messages(BaseRole.get_messages()))
        system = "\n\n".join(m["content"] for m in seen if m["role"] == "system")
        tools = convert_to_openai_tools(_Agent.get_available_tools())
        return {"system_prompt": system, "tools": tools, "max_steps": self.max_steps,
                "messages": [m for m in seen if m["role"] != "system"]}

    def step(self, content, tool_calls) -> dict:
        return self._run(self._step, content, tool_calls)

    def _step(self, content, tool_calls) -> dict:
        if tool_calls:
            return self._tool_turn(tool_calls)
        BaseRole.add_messages([Message(sender=RoleType.AGENT, recipient=RoleType.USER, content=content or "")])
        if self._over():
            return {"messages": [], "done": True, "reason": "max_steps"}
        return {"messages": [], "done": False, "user_turn": self._user_view()}

    def _tool_turn(self, tool_calls: list) -> dict:
        offered = _Agent.get_available_tools()  # agent-facing name -> tool
        names = set(offered)
        start = self._count()
        calls, refused, own_to_agent = [], [], {}
        for tc in tool_calls:
            fn = tc.get("function") if isinstance(tc, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            self.calls += 1
            own = f"tsb_call_{self.calls}"  # the id ToolSandbox's source uses as a Python name: never the model's
            own_to_agent[own] = str(tc.get("id") or own) if isinstance(tc, dict) else own
            args = decode_arguments(fn.get("arguments")) if isinstance(fn, dict) else None
            if not isinstance(name, str) or name not in names:
                refused.append((own, str(name)[:80], f"KeyError: Agent tool call agent_facing_tool_name="
                                f"{str(name)[:80]!r} is not a known allowed tool. Options are {sorted(names)}"))
            elif args is None:
                refused.append((own, name, "ValueError: the tool call's arguments are not a JSON object"))
            elif len(calls) >= MAX_PARALLEL:
                refused.append((own, name, f"ValueError: at most {MAX_PARALLEL} parallel tool calls per turn"))
            else:
                call = ChatCompletionMessageToolCall(id=own, type="function",
                                                     function=Function(name=name, arguments=json.dumps(args)))
                code = openai_tool_call_to_python_code(
                    call, names, execution_facing_tool_name=get_current_context().get_execution_facing_tool_name(name))
                calls.append(Message(sender=RoleType.AGENT, recipient=RoleType.EXECUTION_ENVIRONMENT, content=code,
                                     openai_tool_call_id=own, openai_function_name=name))
        if calls:
            BaseRole.add_messages(calls)
            if self._over():
                return {"messages": [], "done": True, "reason": "max_steps"}
            self.env.respond()
        for own, name, text in refused:  # recorded, never executed: the call and its error
            BaseRole.add_messages([
                Message(sender=RoleType.AGENT, recipient=RoleType.EXECUTION_ENVIRONMENT,
                        content="# refused tool call: not executed", openai_tool_call_id=own, openai_function_name=name),
                Message(sender=RoleType.EXECUTION_ENVIRONMENT, recipient=RoleType.AGENT, content=text,
                        openai_tool_call_id=own, openai_function_name=name, tool_call_exception=text)])
        replies = [m for m in self._since(start)
                   if m.sender == RoleType.EXECUTION_ENVIRONMENT and m.recipient == RoleType.AGENT]
        out, _ = to_openai_messages(replies)
        by_id = {m["tool_call_id"]: {**m, "tool_call_id": own_to_agent[m["tool_call_id"]]} for m in out}
        ordered = [by_id[own] for own in own_to_agent if own in by_id]
        return {"messages": ordered, "done": self._over(), "reason": "max_steps" if self._over() else None}

    def _user_view(self) -> dict:
        """What ToolSandbox's user simulator is shown: its prompt, few-shot turns and the dialogue
        so far (roles reversed), and its one tool, `end_conversation`."""
        messages = OpenAIAPIUser.to_openai_messages(_User.filter_messages(BaseRole.get_messages()))
        tools = [convert_to_openai_tool(tool) for tool in _User.get_available_tools().values()]
        return {"messages": messages, "tools": tools}

    def user_reply(self, content, tool_calls) -> dict:
        """The user simulator's answer (asked on the trace-rl side): text for the agent, or
        `end_conversation`, which ToolSandbox's environment runs; an empty answer ends it too."""
        return self._run(self._user_reply, content, tool_calls)

    def end_conversation(self) -> dict:
        """`user: end`: the user ends the conversation right after the agent's reply."""
        return self._run(self._end, "agent_stop")

    def _user_reply(self, content, tool_calls) -> dict:
        wants_end = any(isinstance(tc, dict) and (tc.get("function") or {}).get("name") == "end_conversation"
                        for tc in tool_calls or [])
        if wants_end or not (content or "").strip():
            return self._end("user_stop")
        start = self._count()
        BaseRole.add_messages([Message(sender=RoleType.USER, recipient=RoleType.AGENT, content=content)])
        seen, _ = to_openai_messages(self._since(start))
        return {"messages": seen, "done": self._over(), "reason": "max_steps" if self._over() else None}

    def _end(self, reason: str) -> dict:
        tools = _User.get_available_tools()
        call = ChatCompletionMessageToolCall(id="tsb_end", type="function",
                                             function=Function(name="end_conversation", arguments="{}"))
        code = openai_tool_call_to_python_code(call, set(tools), execution_facing_tool_name=None)
        BaseRole.add_messages([Message(sender=RoleType.USER, recipient=RoleType.EXECUTION_ENVIRONMENT, content=code)])
        self.env.respond()
        return {"messages": [], "done": True, "reason": reason}

    def score(self, termination: str) -> dict:
        base = {"termination": termination, "categories": categories(self.scenario)}
        if self.error or termination in ("env_error", "llm_error", "context_length") or self.context is None:
            # ToolSandbox's run_scenario scores a scenario whose play raised as 0
            return {"reward": 0.0, "passed": False,
                    "reasons": {**base, "similarity": 0.0, "error": self.error or f"play ended by {termination}"}}
        self._enter()
        try:
            result = self.scenario.evaluation.evaluate(execution_context=get_current_context(),
                                                       max_turn_count=self.scenario.max_messages)
        finally:
            self._leave()
        sim = float(result.similarity)
        matched = lambda mapping: {str(k): [int(i), round(float(s), 4)] for k, (i, s) in mapping.items()}
        reasons = {**base, "similarity": round(sim, 6), "milestone_similarity": round(float(result.milestone_similarity), 6),
                   "minefield_similarity": round(float(result.minefield_similarity), 6),
                   "milestones": len(self.scenario.evaluation.milestone_matcher.milestones),
                   "milestone_matches": matched(result.milestone_mapping),
                   "minefields": len(self.scenario.evaluation.minefield_matcher.milestones),
                   "minefield_matches": matched(result.minefield_mapping), "turn_count": int(result.turn_count)}
        return {"reward": sim, "passed": sim >= 1.0 - 1e-9, "reasons": reasons}

    def close(self) -> None:
        self.context = None


def categories(scenario) -> list[str]:
    return [str(c).lower() for c in scenario.categories if c not in AUGMENTATIONS]


def needs_rapid_api(scenario) -> bool:
    tools = scenario.starting_context.name_to_tool
    return any(getattr(tools.get(n), "__module__", "") == RAPID_API_MODULE
               for n in scenario.starting_context.tool_allow_list or [])


def system_prompt(scenario) -> str:
    db = scenario.starting_context.get_database(DatabaseNamespace.SANDBOX, get_all_history_snapshots=True)
    return "\n\n".join(str(r["content"]) for r in db.to_dicts()
                       if r["sender"] == RoleType.SYSTEM and r["recipient"] == RoleType.AGENT)


def task_text(scenario) -> str:
    """What the user wants (the user simulator's instruction), for the analyst."""
    db = scenario.starting_context.get_database(DatabaseNamespace.SANDBOX, get_all_history_snapshots=True)
    for row in db.to_dicts():
        if row["sender"] == RoleType.SYSTEM and row["recipient"] == RoleType.USER and not row["visible_to"] == [RoleType.USER]:
            return str(row["content"]).replace(USER_INSTRUCTION, "").strip()[:300]
    return ""


class ToolSandboxBench:
    """TRACE's set: ToolSandbox's scenarios without distraction tools (its NO_DISTRACTION_TOOLS
    tag: the 129 written scenarios, none of their tool augmentations), less the RapidAPI ones."""

    def __init__(self):
        random.seed(SEED)
        every = named_scenarios(preferred_tool_backend=ToolBackend.DEFAULT)
        chosen = {n: s for n, s in every.items() if ScenarioCategories.NO_DISTRACTION_TOOLS in s.categories}
        self.excluded = {n: "needs RapidAPI (internet and RAPID_API_KEY)" for n, s in chosen.items()
                         if needs_rapid_api(s)}
        self.scenarios = {n: s for n, s in sorted(chosen.items()) if n not in self.excluded}
        self.set_size = len(chosen)
        self._splits: dict[str, list[str]] = {"all": list(self.scenarios), "base": [], "train": [], "test": []}
        for n, s in self.scenarios.items():
            if ScenarioCategories.SINGLE_USER_TURN in s.categories and not n.endswith(REPHRASED):
                self._splits["base"].append(n)
            self._splits[split_of(n)].append(n)
            for c in categories(s):
                self._splits.setdefault(c, []).append(n)

    def splits(self) -> list[str]:
        return list(self._splits)

    def tasks(self, split: str) -> list[dict]:
        if split not in self._splits:
            raise KeyError(f"toolsandbox has no split {split!r}; choose one of {', '.join(self._splits)}")
        return [{"id": n, "description": task_text(self.scenarios[n]), "categories": categories(self.scenarios[n])}
                for n in self._splits[split]]

    def episode(self, task_id: str) -> ToolSandboxEpisode:
        if task_id not in self.scenarios:
            why = self.excluded.get(task_id, "not a scenario of TRACE's set")
            raise KeyError(f"toolsandbox: no playable scenario {task_id!r} ({why})")
        return ToolSandboxEpisode(task_id, self.scenarios[task_id])

    def spec(self) -> dict:
        task_tools, schemas = {}, {}
        for n, s in self.scenarios.items():
            set_current_context(s.starting_context)  # read only: the converters read its tool augmentations
            tools = convert_to_openai_tools(_Agent.get_available_tools())
            task_tools[n] = [t["function"]["name"] for t in tools]
            schemas.update({t["function"]["name"]: t for t in tools})
        prompt = system_prompt(next(iter(self.scenarios.values())))
        return {"tools": [schemas[k] for k in sorted(schemas)], "policy": prompt, "system_prompt": prompt,
                "task_tools": task_tools, "excluded": self.excluded, "set_size": self.set_size,
                "scenarios": {n: {"categories": categories(s), "family": family(n), "split": split_of(n)}
                              for n, s in self.scenarios.items()}}
