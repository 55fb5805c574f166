"""A small local approval page (127.0.0.1 only): the pending capability list or environment,
with its figures, code, verifier findings and sample episodes, and approve / reject buttons.
Decisions go to RUN_DIR/approvals.json, exactly as `trace-rl approve` writes them."""
from __future__ import annotations

import html
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from trace_rl.core.records import CapabilityRecord, EnvRecord
from trace_rl.graph.approvals import pending_item, record_decision
from trace_rl.graph.report import verifier_report

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
pre{background:#f6f6f6;padding:1em;overflow:auto;max-height:420px;font-size:12px}
.ok{color:#176b2c}.bad{color:#a11}button{font-size:16px;padding:6px 18px;margin-right:1em}"""


def _e(x) -> str:
    return html.escape(str(x))


def _episode(msgs: list[dict]) -> str:
    turns = (f"[{m['role']}] {str(m.get('content') or json.dumps(m.get('tool_calls')))[:300]}" for m in msgs[1:12])
    return "<pre>" + _e("\n".join(turns)) + "</pre>"


def render_capabilities(item: dict, run_dir: Path) -> str:
    caps = [CapabilityRecord.model_validate(c) for c in item["items"]]
    rows = "".join(
        f"<tr><td><input type=checkbox name=approve value='{_e(c.name)}' checked></td><td><b>{_e(c.name)}</b>"
        f"{' (below threshold)' if c.below_threshold else ''}<br><small>{_e(c.description)}</small></td>"
        f"<td>{c.cov_mean:.2f}</td><td>{c.delta_mean:+.2f}</td>"
        f"<td>{c.runs_passed}/{c.n_runs}</td><td>{_e(', '.join(c.example_failed_task_ids[:3]))}</td></tr>"
        for c in caps)
    plots = sorted(Path(run_dir).glob("iter_*/analysis/cov_delta.png"))
    img = f"<img src='/file?path={_e(plots[-1].relative_to(run_dir))}' width=520>" if plots else ""
    return (f"<form method=post action=/decide><input type=hidden name=id value='{_e(item['id'])}'>"
            "<table><tr><th>train</th><th>capability</th><th>Cov</th><th>Δ</th><th>runs passed</th><th>failed examples</th></tr>"
            f"{rows}</table>{img}<p>Reason for the unchecked ones: <input name=reason size=60></p>"
            "<button name=action value=decide id=decide>Submit</button></form>")


def render_environment(item: dict) -> str:
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
                 "<p>Reason (for a rejection): <input name=reason size=60></p>"
                 "<button name=action value=approve id=approve>Approve</button>"
                 "<button name=action value=reject id=reject>Reject</button></form>")
    return "".join(parts)


def page(run_dir: Path, message: str = "") -> str:
    item = pending_item(run_dir, undecided=True)
    body = f"<p class=ok id=message>{_e(message)}</p>" if message else ""
    if item is None:
        body += "<p id=idle>Nothing is waiting for a decision.</p>"
    else:
        body += f"<h2 id=title>{_e(item['title'])}</h2>"
        body += render_capabilities(item, run_dir) if item["kind"] == "capabilities" else render_environment(item)
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


def serve(run_dir: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """Start the page in a background thread; returns the server (`.shutdown()` to stop)."""
    run_dir = Path(run_dir).resolve()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: bytes, ctype: str = "text/html; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/file":
                rel = parse_qs(url.query).get("path", [""])[0]
                target = (run_dir / rel).resolve()
                if run_dir not in target.parents or target.suffix != ".png" or not target.is_file():
                    return self._send(404, b"not found", "text/plain")
                return self._send(200, target.read_bytes(), "image/png")
            if url.path == "/pending.json":
                return self._send(200, json.dumps(pending_item(run_dir)).encode(), "application/json")
            self._send(200, page(run_dir, parse_qs(url.query).get("msg", [""])[0]).encode())

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            item = pending_item(run_dir)
            if item is None or (form.get("id") or [""])[0] != item["id"]:
                return self._send(409, b"that item is no longer pending", "text/plain")
            try:
                decision = decision_from_form(item, form)
            except BadDecision as err:
                return self._send(400, str(err).encode(), "text/plain")
            record_decision(run_dir, item["id"], decision)
            self.send_response(303)
            self.send_header("Location", "/?msg=Decision+recorded%3B+the+run+continues.")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
