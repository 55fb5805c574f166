"""JSON-lines runner inside the sandbox container (stdlib only).

Host -> runner, one JSON object per line:
  {"op": "load", "code": str, "entry": str, "kwargs": {}}   build the object `entry(**kwargs)`
  {"op": "call", "method": str, "args": [], "kwargs": {}}    call a method on it
  {"op": "exec", "code": str}                                 run a snippet, return its stdout
Runner -> host: {"id": <the request's id>, "ok": true, "result": ...} or
                {"id": ..., "ok": false, "error": type, "message": str, "traceback": str}.
Anything the loaded code prints goes to stderr. Code that writes to the protocol channel anyway
(it can find the fd) desyncs the ids or breaks the JSON: the host then discards the session.
Results must be plain JSON: NaN and infinities are refused here, before they reach the host.
"""
import contextlib
import io
import json
import os
import sys
import traceback

MAX_REPLY = int(os.environ.get("TRACE_RL_MAX_REPLY", 4 << 20))


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # user prints (even raw fd 1 writes) now land on stderr
    sys.stdout = sys.stderr
    obj = None
    for line in sys.stdin:
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            op = req["op"]
            if op == "load":
                ns = {"__name__": "trace_rl_env"}
                exec(compile(req["code"], "env.py", "exec"), ns)
                obj = ns[req.get("entry", "Env")](**req.get("kwargs", {}))
                result = None
            elif op == "call":
                if obj is None:
                    raise RuntimeError("call before load")
                result = getattr(obj, req["method"])(*req.get("args", []), **req.get("kwargs", {}))
            elif op == "exec":
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(req["code"], "snippet.py", "exec"), {"__name__": "__main__"})
                result = buf.getvalue()
            else:
                raise ValueError(f"unknown op {op!r}")
            out = json.dumps({"id": rid, "ok": True, "result": result}, allow_nan=False)
            if len(out) > MAX_REPLY:
                raise ValueError(f"reply of {len(out)} bytes exceeds the {MAX_REPLY}-byte cap")
        except BaseException as e:  # report everything; SystemExit in user code included
            if isinstance(e, KeyboardInterrupt):
                raise
            try:
                message = str(e)[:2000]
            except BaseException:  # an exception whose __str__ itself fails
                message = "<unprintable exception>"
            out = json.dumps({"id": rid, "ok": False, "error": type(e).__name__, "message": message,
                              "traceback": traceback.format_exc()[-4000:]})
        proto.write(out + "\n")


if __name__ == "__main__":
    main()
