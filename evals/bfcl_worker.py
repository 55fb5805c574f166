"""The worker side of the built-in BFCL multi-turn benchmark (`evals/bfcl.py`); it runs in
bfcl-eval's own venv and imports only bfcl_eval and the standard library.

Tasks, function docs, ground truth, the backend classes and the verdict are BFCL's own
(`bfcl_eval.utils` loaders, `func_source_code` classes, `multi_turn_checker`). One part is
ours: BFCL runs a model's calls by building Python call strings and `eval`-ing them. Here a
call is an OpenAI tool call (name + JSON arguments) that reaches a backend only through
`Backends.call`: the name must be a function the task offers at that moment and a public
method of one of its classes, and it is called with keyword arguments via getattr. The
checker gets this executor in place of its `eval` one, so live play and scoring share it.

Task ids: `multi_turn_<category>_<n>` (a whole task: every user turn) and
`multi_turn_<category>_<n>.turn<k>` (one turn: turns before k replayed from the ground truth).
"""
from __future__ import annotations

import ast
import atexit
import copy
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile


def _bfcl_root() -> str:
    """BFCL makes result/, score/ and lock folders under BFCL_PROJECT_ROOT when imported (by
    default inside site-packages): give it a folder of the venv, or a temporary one."""
    here = os.path.join(sys.prefix, "bfcl-project")
    try:
        os.makedirs(here, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    tmp = tempfile.mkdtemp(prefix="bfcl-project-")
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


os.environ.setdefault("BFCL_PROJECT_ROOT", _bfcl_root())

from bfcl_eval.constants.default_prompts import (  # noqa: E402
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    MAXIMUM_STEP_LIMIT,
    PROMPT_STYLE_TEMPLATES,
)
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES  # noqa: E402
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as bfcl_checker  # noqa: E402
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
TURN_ID = re.compile(r"^(multi_turn_([a-z_]+)_(\d+))(?:\.turn(\d+))?$")
# BFCL gives function-calling models no system prompt; the agent here has one, so it is BFCL's own
# prompting-mode text (persona, task, multi-turn behaviour) without its output-format part.
_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
SYSTEM_PROMPT = f"{_STYLE['persona']} {_STYLE['task']}\n\n{_STYLE['multiturn_behavior']}"
STEPS_PER_TURN = MAXIMUM_STEP_LIMIT + 2  # BFCL quits a turn after its 21st step with calls; +1 for the reply


def split_of(task_id: str) -> str:
    """train or test, from the scenario number alone: the four categories are variants of the same
    200 scenarios, so a scenario's variants and all their turns land in one split, whatever is added."""
    number = TURN_ID.match(task_id).group(3)
    return "test" if int(hashlib.sha256(f"bfcl-multi-turn:{number}".encode()).hexdigest(), 16) % 2 else "train"


# ---------------------------------------------------------------- function docs -> OpenAI tools
def _openai_types(properties: dict) -> dict:
    """BFCL's `_cast_to_openai_type` (model_handler/utils.py, which needs tree_sitter to import)."""
    for value in properties.values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
            value["description"] = value.get("description", "") + " This is a float type value."
        value["type"] = GORILLA_TO_OPENAPI.get(kind, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _openai_types(value["properties"])
            elif "items" in value:
                items = value["items"]
                items["type"] = GORILLA_TO_OPENAPI[items["type"]]
                if items["type"] == "array" and "items" in items:
                    items["items"]["type"] = GORILLA_TO_OPENAPI[items["items"]["type"]]
                elif items["type"] == "object" and "properties" in items:
                    items["properties"] = _openai_types(items["properties"])
    return properties


def openai_tool(doc: dict) -> dict:
    """One BFCL function doc as an OpenAI function tool: BFCL's `convert_to_tool` type mapping, and
    its rule for APIs without a `response` field (the response schema goes into the description)."""
    doc = copy.deepcopy(doc)
    params = {**doc["parameters"], "type": "object"}
    params["properties"] = _openai_types(params.get("properties", {}))
    description = doc.get("description", "")
    if "response" in doc:
        description += f" The response field has the following schema: {json.dumps(doc['response'])}"
    return {"type": "function", "function": {"name": doc["name"], "description": description, "parameters": params}}


# ---------------------------------------------------------------- the backends and the one executor
def _result_text(result) -> str:
    """A backend's return value as BFCL's executor turns it into text."""
    if type(result) == str:  # noqa: E721 (BFCL's exact test)
        return result
    if type(result) == dict:  # noqa: E721
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


def unavailable(name) -> str:
    return f"Error during execution: {str(name)[:100]!r} is not a function you can call here"


class Backends:
    """One task's BFCL backend instances, loaded with its scenario, and the only way a call reaches them."""

    def __init__(self, entry: dict):
        category = entry["id"].rsplit("_", 1)[0]
        long_context = "long_context" in category or "composite" in category  # BFCL's rule
        self.instances, self.owner = {}, {}
        for class_name in entry["involved_classes"]:
            instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
            if class_name not in STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})),
                                        long_context=long_context)
            self.instances[class_name] = instance
            for method, _ in inspect.getmembers(type(instance), inspect.isfunction):
                if not method.startswith("_"):
                    self.owner[method] = class_name  # a later class wins a shared name, as in BFCL

    def call(self, name, arguments: dict, offered) -> str:
        """Run one call and return BFCL's text for its result. `name` must be in `offered` (the task's
        functions now) and a public method of an involved class; nothing else is looked up."""
        if not isinstance(name, str) or name not in offered or name not in self.owner:
            return unavailable(name)
        method = getattr(self.instances[self.owner[name]], name)
        try:
            return _result_text(method(**copy.deepcopy(arguments)))
        except Exception as err:
            return f"Error during execution: {err}"

    def parse_gold(self, call: str) -> dict:
        """A ground-truth call string (benchmark data, e.g. "sort('report.pdf')") -> {name, arguments}
        by parsing literals (never eval), positional arguments bound to the method's parameter names."""
        node = ast.parse(call, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.owner):
            raise ValueError(f"ground-truth call {call!r} is not a call of a backend method")
        method = getattr(self.instances[self.owner[node.func.id]], node.func.id)
        bound = inspect.signature(method).bind(*[ast.literal_eval(a) for a in node.args],
                                               **{k.arg: ast.literal_eval(k.value) for k in node.keywords})
        return {"name": node.func.id, "arguments": dict(bound.arguments)}


def _verdict(entry: dict, gold_turns: list, model_turns: list) -> dict:
    """BFCL's verdict on a played task: its eval runner's length rule, then `multi_turn_checker` with
    `Backends` as its executor. Turns are lists of steps; a step is a list of calls, each
    {"name", "arguments", "offered"} as recorded when played (gold calls: offered)."""
    if len(model_turns) != len(gold_turns):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"Model was force-terminated during inference phase. The length of the model "
                                 f"result turns ({len(model_turns)}) does not match the length of the ground "
                                 f"truth turns ({len(gold_turns)})."}
    runs: dict[str, Backends] = {}

    def execute(func_call_list, initial_config, involved_classes, model_name, test_entry_id,
                long_context=False, is_evaL_run=False):
        backends = runs.get(model_name) or runs.setdefault(model_name, Backends(entry))
        return [backends.call(c["name"], c["arguments"], [c["name"]] if c["offered"] else ())
                for c in func_call_list], backends.instances

    original = bfcl_checker.execute_multi_turn_func_call
    bfcl_checker.execute_multi_turn_func_call = execute
    try:
        return bfcl_checker.multi_turn_checker(model_turns, gold_turns, entry, entry["id"].rsplit("_", 1)[0],
                                               "trace_rl")
    finally:
        bfcl_checker.execute_multi_turn_func_call = original


def _reasons(verdict: dict) -> dict:
    """The checker's verdict, compactly: its error type, message and the telling part of its details."""
    if verdict.get("valid"):
        return {"checker": "valid"}
    details = verdict.get("details") or {}
    telling = details.get("differences") or details.get("missing_items")
    out = {"error_type": verdict.get("error_type", ""), "error": str(verdict.get("error_message", ""))[:500]}
    if telling:
        out["details"] = json.dumps(telling, default=str)[:1500]
    return out


# ---------------------------------------------------------------- tasks and episodes
class Episode:
    """A whole task (every user turn) or one turn (earlier turns replayed from the ground truth).
    A turn ends when the agent replies without tool calls, when a reply's calls do not decode
    (BFCL executes nothing of it and moves on), or after BFCL's step limit (which fails the task)."""

    def __init__(self, bench: "BfclBench", task_id: str):
        m = TURN_ID.match(task_id)
        if not m or m.group(1) not in bench.entries():
            raise ValueError(f"unknown BFCL multi-turn task {task_id!r}")
        self.entry, self.gold = bench.entries()[m.group(1)]
        self.turn = None if m.group(4) is None else int(m.group(4))
        if self.turn is not None and not (0 <= self.turn < len(self.gold) and self.gold[self.turn]):
            raise ValueError(f"{task_id}: turn {self.turn} is not a checked turn of {m.group(1)}")
        self.last = len(self.gold) - 1 if self.turn is None else self.turn
        self.done, self.force_quit = False, False

    def _open_turn(self, k: int) -> list[dict]:
        """Turn k's user messages; a miss_func turn that adds the held-out functions says so, as BFCL does."""
        added = self.entry.get("missed_function", {}).get(str(k))
        if added:
            self.docs += added
            return [{"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}]
        return [{"role": m["role"], "content": m["content"]} for m in self.entry["question"][k]]

    def _offered(self) -> set:
        return {d["name"] for d in self.docs}

    def tools(self) -> list[dict]:
        return [openai_tool(d) for d in self.docs]

    def reset(self) -> dict:
        self.backends = Backends(self.entry)
        self.docs = list(self.entry["function"])
        self.turns, self.steps, self.count = [], [], 0
        messages = []
        for k in range(0 if self.turn is None else self.turn):  # per turn: BFCL's ground-truth conversation
            messages += self._open_turn(k)
            calls = [self.backends.parse_gold(c) for c in self.gold[k]]
            for i, call in enumerate(calls):
                cid = f"gold_{k}_{i}"
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": cid, "type": "function",
                     "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
                messages.append({"role": "tool", "tool_call_id": cid,  # benchmark data: BFCL runs it unchecked
                                 "content": self.backends.call(call["name"], call["arguments"], self.backends.owner)})
            self.turns.append([[{**c, "offered": True} for c in calls]] if calls else [])
        messages += self._open_turn(len(self.turns))
        return {"system_prompt": SYSTEM_PROMPT, "tools": self.tools(), "messages": messages,
                "max_steps": STEPS_PER_TURN * (self.last + 1 - len(self.turns))}

    def _end_turn(self, messages: list[dict]) -> dict:
        self.turns.append(self.steps)
        self.steps, self.count = [], 0
        if self.force_quit or len(self.turns) > self.last:
            self.done = True
            return {"messages": messages, "done": True, "reason": "max_steps" if self.force_quit else "agent_stop"}
        before = len(self.docs)
        messages = messages + self._open_turn(len(self.turns))
        return {"messages": messages, "done": False, **({"tools": self.tools()} if len(self.docs) != before else {})}

    def step(self, content: str, tool_calls: list) -> dict:
        if self.done:
            raise RuntimeError("the episode is over")
        if not tool_calls:
            return self._end_turn([])
        decoded = []
        for tc in tool_calls:
            fn = tc.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                args = None
            if not isinstance(args, dict) or set(args) == {"__malformed__"}:  # trace-rl's mark of non-JSON text
                args = None
            decoded.append((tc.get("id") or "", fn.get("name"), args))
        if any(args is None for _, _, args in decoded):
            note = ("Error during decoding: the arguments of a call in this reply are not a JSON object; "
                    "nothing in this reply was executed")
            return self._end_turn([{"role": "tool", "tool_call_id": cid, "content": note} for cid, _, _ in decoded])
        offered = self._offered()
        messages, step = [], []
        for cid, name, args in decoded:
            ok = isinstance(name, str) and name in offered
            step.append({"name": name if isinstance(name, str) else str(name), "arguments": args, "offered": ok})
            messages.append({"role": "tool", "tool_call_id": cid, "content": self.backends.call(name, args, offered)})
        self.steps.append(step)
        self.count += 1
        if self.count > MAXIMUM_STEP_LIMIT:
            self.force_quit = True
            return self._end_turn(messages)
        return {"messages": messages, "done": False}

    def score(self, termination: str) -> dict:
        gold = self.gold[: self.last + 1]
        gold_calls = [[self.backends.parse_gold(c) | {"offered": True} for c in turn] for turn in gold]
        verdict = _verdict(self.entry, gold_calls, self.turns)
        reasons = _reasons(verdict)
        if self.turn is not None:
            reasons["turn"] = self.turn
        return {"reward": float(bool(verdict.get("valid"))), "passed": bool(verdict.get("valid")), "reasons": reasons}


def unoffered_gold(entry: dict, gold: list) -> dict:
    """{turn: [names]} where the ground truth calls a function the task does not offer at that turn
    (BFCL's data has one: multi_turn_miss_func_49 calls `tail` at turn 1, held out until turn 3).
    No agent can pass such a turn without calling a function it was not shown: it is left out."""
    offered, out = {d["name"] for d in entry["function"]}, {}
    for k, turn in enumerate(gold):
        offered |= {d["name"] for d in entry.get("missed_function", {}).get(str(k), [])}
        names = sorted({ast.parse(c, mode="eval").body.func.id for c in turn} - offered)
        if names:
            out[k] = names
    return out


class BfclBench:
    """Splits: the categories, `all`, and `train`/`test` (`split_of`). A task record carries its
    checked turns (those with ground-truth calls; BFCL checks no other turn) for the per-turn mode.
    Turns whose ground truth calls a function not offered then are left out (`unoffered_gold`), and
    so is the whole task that holds one."""

    def __init__(self):
        self._entries = None

    def entries(self) -> dict:
        """{task id: (test entry, ground-truth turns)}, loaded once with BFCL's own loaders."""
        if self._entries is None:
            self._entries = {}
            for category in CATEGORIES:
                name = f"multi_turn_{category}"
                gold = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(name)}
                for entry in load_dataset_entry(name):
                    self._entries[entry["id"]] = (entry, gold[entry["id"]])
        return self._entries

    def splits(self) -> list[str]:
        return [*CATEGORIES, "all", "train", "test"]

    def tasks(self, split: str) -> list[dict]:
        if split not in self.splits():
            raise ValueError(f"no split {split!r}; choose one of {', '.join(self.splits())}")
        out = []
        for tid, (entry, gold) in self.entries().items():
            category = TURN_ID.match(tid).group(2)
            if split in CATEGORIES and category != split or split in ("train", "test") and split_of(tid) != split:
                continue
            texts = [" ".join(m["content"] for m in q) or DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
                     for q in entry["question"]]
            left_out = unoffered_gold(entry, gold)
            out.append({"id": tid, "category": category, "description": texts[0][:300],
                        "max_steps": STEPS_PER_TURN * len(gold), "whole": not left_out,
                        "left_out": {str(k): v for k, v in left_out.items()},
                        "turns": [{"turn": k, "description": texts[k][:300], "max_steps": STEPS_PER_TURN}
                                  for k in range(len(gold)) if gold[k] and k not in left_out]})
        return out

    def episode(self, task_id: str) -> Episode:
        return Episode(self, task_id)

    def spec(self) -> dict:
        """Every function as an OpenAI tool, the system prompt, and per task the functions each turn
        adds ({task id: {"0": names offered at the start, "<k>": names a miss_func turn k adds}})."""
        tools, functions = {}, {}
        for tid, (entry, _) in self.entries().items():
            added = {"0": [d["name"] for d in entry["function"]]}
            for k, docs in entry.get("missed_function", {}).items():
                added[k] = added.get(k, []) + [d["name"] for d in docs]
            functions[tid] = added
            for doc in [*entry["function"], *[d for docs in entry.get("missed_function", {}).values() for d in docs]]:
                tools.setdefault(doc["name"], openai_tool(doc))
        return {"tools": list(tools.values()), "policy": SYSTEM_PROMPT, "system_prompt": SYSTEM_PROMPT,
                "task_functions": functions}
