"""The approvals store: RUN_DIR/approvals.json holds a decision per pending item id, written by
`trace-rl approve`, the web page or auto-approve, and read when the graph resumes. Both it and
RUN_DIR/pending.json are read through their models: a file of the wrong shape, or a decision that
names something not pending, is one RunDirError naming the file, the field and the fix."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from trace_rl.core.io import WriterLock, atomic_write_json
from trace_rl.core.rundir import RunDir, RunDirError, read_control

THREAD = {"configurable": {"thread_id": "trace-rl"}}
APPROVALS_FIX = "fix or remove that entry (the decision is asked again)"
PENDING_FIX = "remove it (the run writes it again when it waits)"


class CapabilitiesDecision(BaseModel):
    """On a `capabilities` item: every pending capability approved or rejected (with a reason)."""
    model_config = ConfigDict(extra="forbid")
    approve: list[str]
    reject: dict[str, str] = {}
    by: str = ""
    at: float | None = None


class EnvironmentDecision(BaseModel):
    """On an `environment` item."""
    model_config = ConfigDict(extra="forbid")
    action: Literal["approve", "reject"]
    reason: str = ""
    by: str = ""
    at: float | None = None


class Named(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class PendingItem(BaseModel):
    """RUN_DIR/pending.json: what the run waits on (the graph's interrupt value)."""
    model_config = ConfigDict(extra="allow")
    id: str
    kind: Literal["capabilities", "environment"]
    title: str
    items: list[Named] = []  # capabilities
    capability: Named | None = None  # environment
    verified: bool = False

    @model_validator(mode="after")
    def _of_its_kind(self):
        if self.kind == "environment" and self.capability is None:
            raise ValueError("an environment item names its capability")
        return self


def pending(app) -> list[dict]:
    """Interrupts waiting for a decision (at most one: the graph runs one node at a time)."""
    return [i.value for task in app.get_state(THREAD, subgraphs=True).tasks for i in task.interrupts]


def read_decisions(run_dir: Path) -> dict:
    p = RunDir(run_dir).approvals
    if not p.is_file():
        return {}
    data = read_control(p, dict[str, CapabilitiesDecision | EnvironmentDecision], APPROVALS_FIX)
    return {k: v.model_dump(exclude_unset=True) for k, v in data.items()}


def check_decision(run_dir: Path, item: dict, decision: dict) -> dict:
    """`decision` as the graph can use it on `item`, or a RunDirError naming approvals.json, the item and the
    fix: a decision of the other kind, or one naming a capability that is not pending or leaving one undecided
    (which would stay PENDING forever)."""
    where = f"{RunDir(run_dir).approvals}: the decision on {item['id']}"
    fix = f"fix or remove that entry, then `trace-rl approve {run_dir}`"
    if item["kind"] == "environment":
        if "action" not in decision:
            raise RunDirError(f"{where} has no action (approve or reject); {fix}")
        return decision
    if "approve" not in decision:
        raise RunDirError(f"{where} has no approve list (capability names); {fix}")
    names = [c["name"] for c in item["items"]]
    chosen = set(decision["approve"]) | set(decision.get("reject") or {})
    if ghosts := sorted(chosen - set(names)):
        raise RunDirError(f"{where} names {ghosts[0]!r}, which is not pending (pending: {', '.join(names)}); {fix}")
    if undecided := [n for n in names if n not in chosen]:
        raise RunDirError(f"{where} neither approves nor rejects {undecided[0]!r}; {fix}")
    return decision


def pending_item(run_dir: Path, undecided: bool = False) -> dict | None:
    """The item the run waits on (RUN_DIR/pending.json, written while it waits); with `undecided`,
    None once a decision on it is recorded."""
    p = RunDir(run_dir).pending
    item = read_control(p, PendingItem, PENDING_FIX).model_dump(exclude_unset=True) if p.is_file() else None
    return None if item is None or undecided and item["id"] in read_decisions(run_dir) else item


def record_decision(run_dir: Path, item_id: str, decision: dict) -> None:
    """The decision on `item_id`, unless one is recorded already (a second `approve`, or the page and the CLI at
    once: RunDirError). Under approvals.lock, held only while writing: a run waiting for the decision holds the
    run's own lock, and `trace-rl approve` from another terminal must still reach it."""
    with WriterLock(RunDir(run_dir).approvals_lock, str(RunDir(run_dir).approvals)):
        data = read_decisions(run_dir)
        if item_id in data:
            raise RunDirError(f"{item_id} is already decided ({data[item_id]}); a decision is never overwritten")
        data[item_id] = {**decision, "at": time.time()}
        atomic_write_json(RunDir(run_dir).approvals, data)


def auto_decision(item: dict) -> dict:
    if item["kind"] == "capabilities":
        return {"approve": [c["name"] for c in item["items"]], "reject": {}, "by": "auto"}
    return {"action": "approve" if item.get("verified") else "reject", "by": "auto",
            "reason": "" if item.get("verified") else "not verified; unattended run"}
