"""The approvals store: RUN_DIR/approvals.json holds a decision per pending item id, written by
`trace-rl approve`, the web page or auto-approve, and read when the graph resumes."""
from __future__ import annotations

import time
from pathlib import Path

from trace_rl.core.io import atomic_write_json
from trace_rl.core.rundir import RunDir, read_json_file

THREAD = {"configurable": {"thread_id": "trace-rl"}}


def pending(app) -> list[dict]:
    """Interrupts waiting for a decision (at most one: the graph runs one node at a time)."""
    return [i.value for task in app.get_state(THREAD, subgraphs=True).tasks for i in task.interrupts]


def read_decisions(run_dir: Path) -> dict:
    p = RunDir(run_dir).approvals
    return read_json_file(p, "fix or remove it (decisions are asked again)") if p.is_file() else {}


def pending_item(run_dir: Path, undecided: bool = False) -> dict | None:
    """The item the run waits on (RUN_DIR/pending.json, written while it waits); with `undecided`,
    None once a decision on it is recorded."""
    p = RunDir(run_dir).pending
    item = read_json_file(p, "remove it (the run writes it again when it waits)") if p.is_file() else None
    return None if item is None or undecided and item["id"] in read_decisions(run_dir) else item


def record_decision(run_dir: Path, item_id: str, decision: dict) -> None:
    data = read_decisions(run_dir)
    data[item_id] = {**decision, "at": time.time()}
    atomic_write_json(RunDir(run_dir).approvals, data)


def auto_decision(item: dict) -> dict:
    if item["kind"] == "capabilities":
        return {"approve": [c["name"] for c in item["items"]], "reject": {}, "by": "auto"}
    return {"action": "approve" if item.get("verified") else "reject", "by": "auto",
            "reason": "" if item.get("verified") else "not verified; unattended run"}
