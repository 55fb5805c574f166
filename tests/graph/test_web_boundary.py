"""The approval page is reachable by any site the user visits (a page may post to 127.0.0.1): it answers
only its own host, takes a decision only with its page's token and from no foreign origin, caps what it
reads, refuses a second decision, and answers a malformed request with a status, never a traceback."""
import json
import re
import socket
import urllib.error
import urllib.request

import pytest

from trace_rl.graph.web import serve

ENV_ITEM = {"id": "env:x@0", "kind": "environment", "title": "Environment for x", "verified": True,
            "capability": {"name": "x", "description": "d"},
            "env": {"env": None, "status": "verified", "source": "builder", "rounds": 1}}


@pytest.fixture
def page(tmp_path):
    (tmp_path / "pending.json").write_text(json.dumps(ENV_ITEM))
    server = serve(tmp_path, 0)
    yield tmp_path, server.server_port
    server.shutdown()


def token_of(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        return re.search(r"name=token value='([^']+)'", r.read().decode()).group(1)


def post(port, body: bytes, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/decide", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def raw(port, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_decision_needs_the_page_token_and_is_taken_once(page):
    run_dir, port = page
    form = "id=env%3Ax%400&action=approve&token="
    assert post(port, form.encode())[0] == 403  # no token: a page on another site cannot know it
    assert post(port, (form + "guess").encode())[0] == 403
    assert not (run_dir / "approvals.json").exists()
    token = token_of(port)
    status, _ = post(port, (form + token).encode())
    assert status == 200  # the 303 is followed to the page
    assert json.loads((run_dir / "approvals.json").read_text())["env:x@0"]["action"] == "approve"
    again = "id=env%3Ax%400&action=reject&token=" + token
    assert post(port, again.encode())[0] == 409  # decided: a second decision does not overwrite the first
    assert json.loads((run_dir / "approvals.json").read_text())["env:x@0"]["action"] == "approve"


def test_a_foreign_origin_or_host_is_refused(page):
    run_dir, port = page
    form = ("id=env%3Ax%400&action=reject&token=" + token_of(port)).encode()
    assert post(port, form, {"Origin": "https://evil.example"})[0] == 403
    answer = raw(port, b"GET /pending.json HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400")  # DNS rebinding: another name for 127.0.0.1 gets nothing
    assert b"env:x@0" not in answer
    ok = raw(port, f"GET /pending.json HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n".encode())
    assert ok.startswith(b"HTTP/1.1 200") and b"env:x@0" in ok
    assert not (run_dir / "approvals.json").exists()


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /decide HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\nConnection: close\r\n\r\n", b"400"),
    (b"POST /decide HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999\r\nConnection: close\r\n\r\n", b"413"),
    (b"POST /decide HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\nConnection: close\r\n\r\n\xff\xfe\xfd\xfc",
     b"400"),
])
def test_malformed_requests_get_a_status_not_a_traceback(page, request_bytes, status):
    run_dir, port = page
    answer = raw(port, request_bytes)
    assert answer.split(b" ")[1] == status, answer[:300]
    assert not (run_dir / "approvals.json").exists()
    assert raw(port, b"GET /pending.json HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200")  # still serving


def test_a_body_over_the_cap_is_not_read(page):
    run_dir, port = page
    big = ("id=env%3Ax%400&action=approve&token=" + token_of(port) + "&pad=" + "a" * (80 << 10)).encode()
    assert post(port, big)[0] == 413
    assert not (run_dir / "approvals.json").exists()
