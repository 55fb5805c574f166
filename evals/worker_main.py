"""The worker side of a benchmark that lives in another Python (stdlib only: it runs there).

    /other/venv/bin/python worker_main.py path/to/side.py:Class      (or package.module:Class)

`Class()` has splits(), tasks(split) -> [{"id", "description"}], episode(task_id) -> an object
with reset() -> {"system_prompt" (null: none is sent), "tools", "messages", ["done", "reason", "max_steps",
"text_tool_calls"]},
step(content, tool_calls) -> {"messages", "done", "reason"}, score(termination) ->
{"reward", "passed", "reasons"} and optionally close(); spec() is optional. An episode's other
public methods are reached as {"op": "call", "args": [eid, "method", ...]}, for the benchmark's own
trace-rl side (ToolSandbox's user-simulator reply is asked on that side and sent back so).
Requests, one JSON object per line on stdin: {"id", "op", "args"}; replies on stdout:
{"id", "ok": true, "result"} or {"id", "ok": false, "error", "message"}. Anything the
benchmark prints goes to stderr, so it cannot corrupt the protocol.
"""
import importlib
import importlib.util
import itertools
import json
import os
import sys
import traceback


def load(target):
    where, _, attr = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("trace_rl_worker_side", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, attr)()


def host_pid():
    """This process's pid as the host sees it: the worker runs in a PID namespace of its own (where it is 1),
    but /proc is still the host's."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def public(name):
    if not isinstance(name, str) or name.startswith("_"):
        raise AttributeError(f"an episode's {name!r} is not callable from trace-rl: public methods only")
    return name


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    bench = load(sys.argv[1])
    episodes, ids = {}, itertools.count(1)

    def open_episode(task_id):
        eid = next(ids)
        episodes[eid] = bench.episode(task_id)
        return eid

    ops = {
        "splits": lambda: list(bench.splits()),
        "tasks": lambda split: list(bench.tasks(split)),
        "spec": lambda: bench.spec() if hasattr(bench, "spec") else None,
        "open": open_episode,
        "reset": lambda eid: episodes[eid].reset(),
        "step": lambda eid, content, tool_calls: episodes[eid].step(content, tool_calls),
        "score": lambda eid, termination: episodes[eid].score(termination),
        "close": lambda eid: getattr(episodes.pop(eid, None), "close", lambda: None)(),
        "call": lambda eid, method, *args: getattr(episodes[eid], public(method))(*args),
        "pid": host_pid,
    }
    for line in sys.stdin:
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            out = json.dumps({"id": rid, "ok": True, "result": ops[req["op"]](*req.get("args", []))}, allow_nan=False)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            out = json.dumps({"id": rid, "ok": False, "error": type(e).__name__, "message": str(e)[:2000],
                              "traceback": traceback.format_exc()[-3000:]})
        proto.write(out + "\n")


if __name__ == "__main__":
    main()
