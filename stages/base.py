"""The contract every stage follows.

A stage is a module (or package) in `stages/` exposing:

    VERSION: str              # bump when the code changes what the stage writes
    def run(cfg, *, inputs, out, ctx) -> StageResult

and listed in the stage table (`pipeline/plan.py`: name, run function, config sections, inputs).
Its module imports no torch at the top (the pipeline core and the data stages stay torch-free).
`cfg` is the stage's own config section (further sections by name; `model` is `deberta.config.DebertaConfig`,
which the model library builds from directly), `inputs` maps upstream stage names to finished `Artifact`s (or the
resolved external inputs: `raw`, `task`), `out` is an empty temporary directory that becomes the artifact when `run`
returns (so a stage never needs its own atomic-write logic), and `ctx` carries what is not configuration: where to
keep state that must survive a failed attempt, the MLflow tracker of the stage's run, and the lineage ids for
registry tags.
A stage raises `StageInputError` for problems a user can fix; the runner prints its message.

Two more functions are optional, both called on the driver before Ray starts, and named in the stage table
(`check=`, `prepare=`) when a stage has them:

    def check(cfg, *, other sections) -> None      # rules across its sections, beside `validate` (ConfigError)
    def prepare(cfg, *, other sections, planned, workdir, overrides) -> Prepared

`prepare` resolves, once, what the stage's settings bring in from outside the pipeline (a released checkpoint to
start from) and says what that implies for the rest of the run (`Prepared`); `planned` names the stages this run
plans, `overrides` are the command line's `--set` items (what the user asked for by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.lineage import Tracker


@dataclass(frozen=True)
class StageContext:
    artifact_id: str
    """Id of the artifact being built (also in the MLflow run's tags)."""
    workdir: Path
    """The pipeline's working directory (absolute)."""
    scratch: Path
    """Persistent per-artifact directory for state that must survive a failed attempt (checkpoints)."""
    storage_path: str
    """Ray Train/Tune storage (a local path or a pyarrow.fs URI every node can reach)."""
    tracker: "Tracker"
    """MLflow run of this stage (picklable; safe to use from Ray workers, rank 0 only)."""
    lineage: dict[str, str] = field(default_factory=dict)
    """Artifact ids upstream of this stage, e.g. {"corpus": "...", "vocab": "..."} (for registry tags)."""
    preset: str = "debug"
    """Name of the preset (registered model names derive from it)."""
    stage: str = "stage"
    """Name of the stage (its Ray Train / Tune runs are named after it)."""

    @property
    def run_name(self) -> str:
        """Name of the stage's Ray Train / Tune run under `storage_path` (its resumable state: `--force STAGE`
        discards every run whose name starts with it, and `scratch`)."""
        return f"{self.stage}-{self.artifact_id}"


@dataclass
class StageResult:
    metrics: dict[str, float] = field(default_factory=dict)
    """Final numbers, logged on the stage's MLflow run."""
    counts: dict[str, int] = field(default_factory=dict)
    """Row/token/document counts, recorded in manifest.json."""
    log_files: tuple[str, ...] = ()
    """Files (relative to `out`) to log as MLflow artifacts of the stage run (reports, plots)."""
    summary: dict[str, str] = field(default_factory=dict)
    """Short facts for the end-of-run summary (e.g. registered model versions)."""


@dataclass(frozen=True)
class Prepared:
    """What a stage's outside inputs imply for the run (its `prepare`): the inputs themselves, the configuration
    they decide, and the stages that read them."""

    objects: dict[str, Any] = field(default_factory=dict)
    """The outside inputs by name, each with an `id` (a digest) that the artifact ids of the stages reading it build
    on, e.g. {"init": ExternalCheckpoint}."""
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Config fields these inputs decide, {section: {field: value}} (a checkpoint's architecture, its tokenizer's
    size); the run is validated again with them."""
    adds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """{stage: inputs it reads besides those of the stage table}."""
    replaces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """{stage: the only inputs it reads}: such a stage makes its artifact from them alone, none of its own settings
    hashed into its id (the vocab stage copying a checkpoint's tokenizer trains nothing)."""
    notes: dict[str, str] = field(default_factory=dict)
    """{stage: what the plan says beside it}."""
