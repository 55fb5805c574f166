"""The approval web page in a real browser (Debian's headless Chromium driven by Playwright):
a run waits at an environment approval, the page shows it, a click approves it, the run goes on."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from paths import SUPPORT

pytestmark = [pytest.mark.docker]
PYTHONPATH = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))  # children import what we do
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if json.loads(r.read()) is not None:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} never showed a pending item")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (scripts/setup.sh --browser)")
def test_environment_approved_in_the_browser_and_the_run_continues(tmp_path, sandbox_image):
    from playwright.sync_api import sync_playwright

    port = free_port()
    code = ("from graph_doubles import config; from trace_rl.graph.pipeline import drive\n"
            f"r = drive({str(tmp_path)!r}, config(auto_approve=False, approvals=['environments']), resume=False,"
            f" wait=True, web_port={port}, log=lambda *a: None)\n"
            "print('STATUS', r['status'], sorted(r['state']['adapters']))")
    run = subprocess.Popen([sys.executable, "-c", code], cwd=SUPPORT, env={**os.environ, "PYTHONPATH": PYTHONPATH},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/pending.json")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS[1:], headless=True)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/")
            assert page.inner_text("#title") == "Environment for lookup_before_answering"
            assert "class Env(Environment)" in page.inner_text("#code")
            assert "reference_solver" in page.content() and "Sample episode: solver" in page.content()
            page.click("#approve")
            page.wait_for_selector("#message")
            assert "Decision recorded" in page.inner_text("#message")
            page.screenshot(path=str(tmp_path / "approved.png"))
            browser.close()
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-3000:]
    assert "STATUS done ['lookup_before_answering']" in out  # approved on the page, then trained
    decisions = json.loads((tmp_path / "approvals.json").read_text())
    assert decisions["env:lookup_before_answering@0"]["action"] == "approve"
    assert decisions["env:lookup_before_answering@0"]["by"] == "web"


@pytest.mark.parametrize("form", ["id=capabilities%400&approve=no_such_capability",
                                  "id=env%3Ax%400&action=delete"])
def test_a_decision_naming_nothing_pending_is_400_and_not_recorded(tmp_path, form):
    from trace_rl.graph.web import serve

    item = ({"id": "capabilities@0", "kind": "capabilities", "title": "t", "items": [{"name": "real_capability_x"}]}
            if form.startswith("id=capabilities") else
            {"id": "env:x@0", "kind": "environment", "title": "t", "capability": {"name": "x"}})
    (tmp_path / "pending.json").write_text(json.dumps(item))
    server = serve(tmp_path, 0)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/", method="POST",
                                     data=f"{form}&token={server.token}".encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400
    finally:
        server.shutdown()
    assert not (tmp_path / "approvals.json").exists()


def test_a_broken_pending_file_is_its_one_line_error_on_every_route(tmp_path):
    from trace_rl.graph.web import serve

    (tmp_path / "pending.json").write_text(json.dumps({"id": "env:x@0", "kind": "environment", "title": "t"}))
    server = serve(tmp_path, 0)
    try:
        for method, path, data in (("GET", "/", None), ("GET", "/pending.json", None),
                                   ("POST", "/decide", f"id=env%3Ax%400&action=approve&token={server.token}".encode())):
            req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}{path}", method=method, data=data)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            text = err.value.read().decode()
            assert err.value.code == 503 and "pending.json" in text and "capability" in text and "\n" not in text
    finally:
        server.shutdown()
    assert not (tmp_path / "approvals.json").exists()
