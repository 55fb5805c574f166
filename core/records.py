"""Typed run records: what the stages hand each other and what state, report, `trace-rl status`
and the web page read. One definition each; a status is a Literal, never a loose string."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CapabilityStatus = Literal["PENDING", "APPROVED", "REJECTED", "NO_CONTRAST"]
EnvStatus = Literal["verified", "needs_human", "human_approved", "rejected"]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Capability(Record):
    """A capability: what every stage that passes one (analyst, env-builder, verifier, training, composition,
    evaluation) passes. JSON: {"name", "description"}."""
    name: str
    description: str = ""


TrainedOn = Capability  # the name LangGraph checkpoints of earlier runs record for an adapter's capability


class CapabilityRecord(Capability):
    """One discovered capability after K-of-N aggregation (and, later, the human's decision)."""
    cov_mean: float = 0.0
    cov_std: float = 0.0
    delta_mean: float = 0.0
    delta_std: float = 0.0
    runs_passed: int = 0
    n_runs: int = 0
    kept: bool = False
    status: CapabilityStatus = "PENDING"
    example_failed_task_ids: list[str] = Field(default_factory=list)
    reliable_runs: int = 0
    reason: str = ""  # why it was not kept, or why a human rejected it
    below_threshold: bool = False  # trained although not kept (train_unkept): reported as such
    runs: list[dict] = Field(default_factory=list)  # per labelling run: cov, delta, passed, reliable


class CapabilitiesFile(BaseModel):
    """An analysis's capabilities.json (agents/analyst.py writes it): the capabilities and the figures beside them."""
    model_config = ConfigDict(extra="allow")
    capabilities: list[CapabilityRecord]


PATTERN_NOTE = "pattern-built: code expanded the model's choice"  # said wherever a pattern env is reported


class EnvRecord(Record):
    """The synthesis outcome for one capability."""
    status: EnvStatus
    env: str | None = None  # path of the environment module
    rounds: int = 0
    source: str = "builder"  # "builder", "library:<name>", or "pattern:<name>" (code expanded the builder's choice)
    approved: bool | None = None
    substitute: str | None = None  # set when a library environment stood in for the builder's
    trained_on: Capability | None = None  # a library substitute's, when one stood in
    findings: str | None = None  # the last verifier findings
    reason: str | None = None  # why it needs a human, or why it was rejected


class HeldOut(Record):
    success: float
    mean_reward: float
    episodes: int


class AdapterRecord(Record):
    """One capability's training: held-out success before and after GRPO, the adapter."""
    trained_on: Capability  # what it really trained on (a library substitute's, when one stood in)
    before: HeldOut | None = None
    after: HeldOut | None = None
    adapter: str | None = None
    steps: int | None = None
    curve: str | None = None
    untrained: bool = False  # every LoRA B matrix still zero: left out of the composition
    substitute: str | None = None


RECORD_TYPES = (Capability, CapabilityRecord, EnvRecord, HeldOut, AdapterRecord)
