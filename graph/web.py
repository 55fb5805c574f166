"""A small local approval page (127.0.0.1 only): the pending capability list or environment,
with its figures, code, verifier findings and sample episodes, and approve / reject buttons.
Decisions go to RUN_DIR/approvals.json, exactly as `trace-rl approve` writes them.

Any site the user visits can send requests to 127.0.0.1, so the page trusts nothing it is sent: HTTP is
parsed by uvicorn and starlette (not by hand), only a 127.0.0.1/localhost Host is answered (no DNS
rebinding), a form needs the page's own secret token and no foreign Origin (no cross-site posts), bodies
are capped at 64 KiB, and an item already decided answers 409 instead of being overwritten."""
from __future__ import annotations

import html
import json
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

from trace_rl.core.records import CapabilityRecord, EnvRecord
from trace_rl.core.rundir import RunDir, RunDirError
from trace_rl.graph.approvals import pending_item, read_decisions, record_decision
from trace_rl.graph.report import verifier_report

MAX_BODY = 64 << 10
HOSTS = ("127.0.0.1", "localhost")

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
pre{background:#f6f6f6;padding:1em;overflow:auto;max-height:420px;font-size:12px}
.ok{color:#176b2c}.bad{color:#a11}button{font-size:16px;padding:6px 18px;margin-right:1em}"""


def _e(x) -> str:
    return html.escape(str(x))


def _episode(msgs: list[dict]) -> str:
    turns = (f"[{m['role']}] {str(m.get('content') or json.dumps(m.get('tool_calls')))[:300]}" for m in msgs[1:12])
    return "<pre>" + _e("\n".join(turns)) + "</pre>"


def render_capabilities(item: dict, run_dir: Path, token: str) -> str:
    caps = [CapabilityRecord.model_validate(c) for c in item["items"]]
    rows = "".join(
        f"<tr><td><input type=checkbox name=approve value='{_e(c.name)}' checked></td><td><b>{_e(c.name)}</b>"
        f"{' (below threshold)' if c.below_threshold else ''}<br><small>{_e(c.description)}</small></td>"
        f"<td>{c.cov_mean:.2f}</td><td>{c.delta_mean:+.2f}</td>"
        f"<td>{c.runs_passed}/{c.n_runs}</td><td>{_e(', '.join(c.example_failed_task_ids[:3]))}</td></tr>"
        for c in caps)
    run = RunDir(run_dir)
    plots = [plot for i in run.iterations() if (plot := run.analysis(i).plot).is_file()]
    img = f"<img src='/file?path={_e(plots[-1].relative_to(run_dir))}' width=520>" if plots else ""
    return (f"<form method=post action=/decide><input type=hidden name=id value='{_e(item['id'])}'>"
            f"<input type=hidden name=token value='{_e(token)}'>"
            "<table><tr><th>train</th><th>capability</th><th>Cov</th><th>Δ</th><th>runs passed</th><th>failed examples</th></tr>"
            f"{rows}</table>{img}<p>Reason for the unchecked ones: <input name=reason size=60></p>"
            "<button name=action value=decide id=decide>Submit</button></form>")


def render_environment(item: dict, token: str) -> str:
    env = EnvRecord.model_validate(item["env"])
    parts = [f"<p>Capability <b>{_e(item['capability']['name'])}</b>: {_e(item['capability']['description'])}</p>",
             f"<p>Status: <b class={'ok' if item.get('verified') else 'bad'}>{_e(env.status)}</b>, source "
             f"{_e(env.source)}, builder rounds {_e(env.rounds)}</p>"]
    if env.env and (report := verifier_report(env.env)):
        parts.append("<h3>Verifier findings</h3><table><tr><th>check</th><th>result</th><th>detail</th></tr>" + "".join(
            f"<tr><td>{_e(f['check'])}</td><td class={'ok' if f['passed'] else 'bad'}>{'pass' if f['passed'] else 'FAIL'}"
            f"</td><td>{_e(f['detail'])}</td></tr>" for f in report.get("findings", [])) + "</table>")
        if c := report.get("calibration"):
            parts.append(f"<p>Calibration with the base model: mean reward {c['mean_reward']:.2f}, success "
                         f"{c['success_rate']:.2f}, informative groups {c['informative_groups']:.2f}</p>")
        for name, msgs in (report.get("samples") or {}).items():
            parts.append(f"<h3>Sample episode: {_e(name)}</h3>{_episode(msgs)}")
    if env.env and (path := Path(env.env)).is_file():
        parts.append(f"<h3>Code ({_e(path.name)})</h3><pre id=code>{_e(path.read_text())}</pre>")
    parts.append(f"<form method=post action=/decide><input type=hidden name=id value='{_e(item['id'])}'>"
                 f"<input type=hidden name=token value='{_e(token)}'><p>Reason (for a rejection): <input name=reason size=60></p>"
                 "<button name=action value=approve id=approve>Approve</button>"
                 "<button name=action value=reject id=reject>Reject</button></form>")
    return "".join(parts)


def page(run_dir: Path, token: str, message: str = "") -> str:
    item = pending_item(run_dir, undecided=True)
    body = f"<p class=ok id=message>{_e(message)}</p>" if message else ""
    if item is None:
        body += "<p id=idle>Nothing is waiting for a decision.</p>"
    else:
        body += f"<h2 id=title>{_e(item['title'])}</h2>"
        body += (render_capabilities(item, run_dir, token) if item["kind"] == "capabilities"
                 else render_environment(item, token))
    return (f"<!doctype html><html><head><meta charset=utf-8><title>trace-rl approvals</title><style>{STYLE}</style>"
            f"</head><body><h1>trace-rl: {_e(Path(run_dir).name)}</h1>{body}</body></html>")


class BadDecision(ValueError):
    """A form naming something that is not pending: answered 400, nothing recorded."""


def decision_from_form(item: dict, form: dict[str, list[str]]) -> dict:
    reason = (form.get("reason") or [""])[0]
    if item["kind"] == "capabilities":
        approve = form.get("approve", [])
        if unknown := sorted(set(approve) - {c["name"] for c in item["items"]}):
            raise BadDecision(f"not pending: {', '.join(unknown)}")
        return {"approve": approve, "reject": {c["name"]: reason or "rejected on the web page"
                                               for c in item["items"] if c["name"] not in approve}, "by": "web"}
    action = (form.get("action") or [""])[0]
    if action not in ("approve", "reject"):
        raise BadDecision(f"action must be approve or reject, got {action!r}")
    return {"action": action, "reason": reason, "by": "web"}


def app(run_dir: str | Path, token: str | None = None):
    """The page as an ASGI app (starlette): GET /, /pending.json, /file?path=x.png; POST /decide."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
    from starlette.routing import Route

    run_dir, token = Path(run_dir).resolve(), token or secrets.token_urlsafe(24)
    lock = threading.Lock()  # two posts at once: the second finds the item decided

    async def index(request):
        return HTMLResponse(page(run_dir, token, request.query_params.get("msg", "")))

    async def pending(request):
        return JSONResponse(pending_item(run_dir))

    async def file(request):
        target = (run_dir / request.query_params.get("path", "")).resolve()
        if run_dir not in target.parents or target.suffix != ".png" or not target.is_file():
            return PlainTextResponse("not found", 404)
        return FileResponse(target, media_type="image/png")

    async def decide(request):
        origin = request.headers.get("origin")
        if origin is not None and origin.split("://", 1)[-1].split(":")[0] not in HOSTS:
            return PlainTextResponse(f"a form from {origin} is not accepted", 403)
        try:
            length = int(request.headers.get("content-length", "0"))
        except ValueError:
            return PlainTextResponse("bad Content-Length", 400)
        if length > MAX_BODY:
            return PlainTextResponse(f"body over {MAX_BODY} bytes", 413)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return PlainTextResponse(f"body over {MAX_BODY} bytes", 413)
        try:
            form = parse_qs(body.decode("utf-8", errors="strict"), strict_parsing=bool(body))
        except (UnicodeDecodeError, ValueError):
            return PlainTextResponse("the form is not UTF-8 url-encoded", 400)
        if not secrets.compare_digest((form.get("token") or [""])[0], token):
            return PlainTextResponse("missing or wrong page token: reload the page", 403)
        with lock:
            item = pending_item(run_dir)
            item_id = (form.get("id") or [""])[0]
            if item is None or item_id != item["id"] or item_id in read_decisions(run_dir):
                return PlainTextResponse("that item is no longer pending (or already decided)", 409)
            try:
                decision = decision_from_form(item, form)
            except BadDecision as err:
                return PlainTextResponse(str(err), 400)
            try:
                record_decision(run_dir, item["id"], decision)
            except RunDirError as err:  # decided meanwhile by `trace-rl approve` in another process
                return PlainTextResponse(str(err), 409)
        return RedirectResponse("/?msg=Decision+recorded%3B+the+run+continues.", 303)

    async def unreadable(request, err):  # a hand-edited or truncated pending.json: its one-line error, no traceback
        return PlainTextResponse(str(err), 503)

    return Starlette(routes=[Route("/", index), Route("/pending.json", pending), Route("/file", file),
                             Route("/", decide, methods=["POST"]), Route("/decide", decide, methods=["POST"])],
                     middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(HOSTS))],
                     exception_handlers={RunDirError: unreadable})


class PageServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; `.server_port`, `.shutdown()`."""

    def __init__(self, asgi, port: int = 0, token: str = ""):
        import uvicorn

        self.token = token  # the forms' secret, for a caller that posts without reading the page
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.server_port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(asgi, log_level="error", access_log=False, lifespan="off",
                                                    h11_max_incomplete_event_size=MAX_BODY))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(run_dir: str | Path, port: int = 0) -> PageServer:
    """Start the page in a background thread; returns the server (`.shutdown()` to stop)."""
    token = secrets.token_urlsafe(24)
    return PageServer(app(run_dir, token), port, token)
