"""`--force STAGE` drops what a re-run would resume from, and nothing else (pipeline.executor)."""

from __future__ import annotations

from pipeline.executor import discard_resumable_state
from pipeline.plan import STAGES, PlannedStage
from core.artifacts import ArtifactStore


def test_force_discards_the_stages_scratch_and_ray_runs_only(tmp_path):
    """The Ray Train run of the forced artifact (`pretrain-<id>`, whose checkpoints Ray Train would restore and
    train nothing) and its scratch go; other artifacts' runs, other stages' runs and the artifacts stay."""
    store, storage = ArtifactStore(tmp_path / "wd"), tmp_path / "ray_results"
    spec = next(s for s in STAGES if s.name == "pretrain")
    forced = PlannedStage(spec, "abc", {}, {}, cached=False, selected=True, forced=True)
    (store.scratch(spec.name, "abc") / "state").write_text("resume me")
    kept_scratch = store.scratch(spec.name, "other")
    runs = {name: storage / name / "checkpoint_000001" for name in
            ("pretrain-abc", "pretrain-abc-retry", "pretrain-other", "finetune-abc")}
    for ckpt in runs.values():
        ckpt.mkdir(parents=True)
    artifact = store.path(spec.name, "abc")
    artifact.mkdir(parents=True)

    gone = discard_resumable_state(forced, store, str(storage))

    assert sorted(gone) == sorted([str(store.scratch_path(spec.name, "abc")), str(storage / "pretrain-abc"),
                                   str(storage / "pretrain-abc-retry")])
    assert sorted(p.name for p in storage.iterdir()) == ["finetune-abc", "pretrain-other"]
    assert kept_scratch.is_dir() and artifact.is_dir()
    assert discard_resumable_state(forced, store, str(storage)) == []  # nothing left to drop: said as (none)
