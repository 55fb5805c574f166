"""Test doubles. A scripted LLM stands in for a model only where graph or parsing
logic is under test; real-model tests use the embedded models."""
from __future__ import annotations

import json

from trace_rl.models.scripted import ScriptedLLM  # noqa: F401  (the public helper: tests import it from here too)


def endpoint_error(status: int, message: str, code: str | None = None):
    """The openai client's exception for an HTTP `status` answer (BadRequestError for 400, ...),
    as `OpenAI().chat.completions.create` raises it: OpenAI-style error body, no network."""
    from types import SimpleNamespace

    import openai

    cls = {400: openai.BadRequestError, 422: openai.UnprocessableEntityError}.get(
        status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    response = SimpleNamespace(status_code=status, request=None, headers={})  # what APIStatusError reads
    return cls(f"Error code: {status} - {{'error': {body}}}", response=response, body=body)


def labels_answer(items: list[dict]) -> str:
    """A labelling answer in the analyst's shape, {trajectory: {capability: label and evidence}},
    from flat items {"trajectory", "capability", "label", ...}."""
    out: dict = {}
    for item in items:
        rest = {k: v for k, v in item.items() if k not in ("trajectory", "capability")}
        out.setdefault(item["trajectory"], {})[item["capability"]] = rest
    return json.dumps(out)


def cli_main(*args) -> tuple[int, str]:
    """`trace-rl ARGS` in this process, as the console script runs it (monkeypatched models apply):
    (exit code, what it printed)."""
    import io
    import sys

    from trace_rl.graph import cli

    # the console's own stream, not `.file` (which reads sys.stdout when unset: restoring that would pin this
    # test's captured stdout into the console for every later test)
    real, cli.console.file = cli.console._file, io.StringIO()
    sys.argv = ["trace-rl", *args]
    try:
        cli.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        out, cli.console.file = cli.console.file.getvalue(), real
    return code, out
