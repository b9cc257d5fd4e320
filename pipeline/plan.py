"""The stage graph and the plan of one invocation.

Every stage's artifact id is computable before anything runs (it hashes the stage's config
and its inputs' ids), so the plan knows up front which stages are cached and which will run.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from pipeline.artifacts import ArtifactStore, artifact_id, canonical_json
from pipeline.config import PipelineConfig


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str
    sections: tuple[str, ...]
    """Config sections handed to the stage's `run` (the first positionally, the rest by name)."""
    inputs: tuple[str, ...]
    """Upstream stages whose artifacts the stage reads."""
    help: str


STAGES: tuple[StageSpec, ...] = (
    StageSpec("corpus", "stages.corpus", ("corpus",), ("raw",),
              "exact + MinHash-LSH dedup, Parquet shards, 5% validation split (Ray Data)"),
    StageSpec("vocab", "stages.vocab", ("vocab",), ("corpus",),
              "SentencePiece vocabulary with fixed special-token ids"),
    StageSpec("tokenize", "stages.tokenize", ("tokenize",), ("corpus", "vocab"),
              "packed uint32 token sequences in Parquet shards (Ray Data)"),
    StageSpec("pretrain", "stages.pretrain", ("pretrain", "model"), ("tokenize", "vocab", "corpus"),
              "DeBERTa MLM + EMD pretraining, Ray Train + DeepSpeed ZeRO, MLflow registry"),
    StageSpec("finetune", "stages.finetune", ("finetune", "model"), ("pretrain", "vocab", "task"),
              "Ray Tune sweep over the Table 9 grid (+SiFT), champion in the MLflow registry"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def available(spec: StageSpec) -> bool:
    """A stage is in the plan only once its module exists: nothing pretends to run."""
    return importlib.util.find_spec(spec.module) is not None


def load(spec: StageSpec) -> Any:
    return importlib.import_module(spec.module)


@dataclass(frozen=True)
class PlannedStage:
    spec: StageSpec
    artifact_id: str
    config: dict[str, Any]
    """The stage's resolved config sections, {section: dict}."""
    input_ids: dict[str, str]
    cached: bool
    run: bool
    """False for stages outside --only/--until that are only needed as (cached) inputs."""


def stage_config(cfg: PipelineConfig, spec: StageSpec) -> dict[str, Any]:
    return {s: dataclasses.asdict(getattr(cfg, s)) for s in spec.sections}


def make_plan(cfg: PipelineConfig, store: ArtifactStore, external_ids: dict[str, str],
              only: str | None = None, until: str | None = None, force: tuple[str, ...] = (),
              stages: tuple[StageSpec, ...] = STAGES) -> list[PlannedStage]:
    """Resolve artifact ids of the available stages up to `until` (or just `only`).

    `external_ids` holds ids of inputs that are not stages (the raw corpus fingerprint, the task).
    """
    specs = [s for s in stages if available(s)]
    names = [s.name for s in specs]
    last = only or until
    if last is not None:
        if last not in STAGE_NAMES:
            raise ValueError(f"unknown stage {last!r}; stages are {', '.join(STAGE_NAMES)}")
        if last not in names:
            raise ValueError(f"stage {last!r} is not built yet; available stages are {', '.join(names)}")
        specs = specs[: names.index(last) + 1]
    ids = dict(external_ids)
    plan = []
    for spec in specs:
        config = stage_config(cfg, spec)
        input_ids = {}
        for name in spec.inputs:
            if name not in ids:
                raise ValueError(f"stage {spec.name!r} needs {name!r}, which is not available")
            input_ids[name] = ids[name]
        art_id = artifact_id(spec.name, getattr(load(spec), "VERSION", "1"), canonical_json(config), input_ids)
        ids[spec.name] = art_id
        cached = store.find(spec.name, art_id) is not None and spec.name not in force
        plan.append(PlannedStage(spec, art_id, config, input_ids, cached, run=only is None or spec.name == only))
    return plan
