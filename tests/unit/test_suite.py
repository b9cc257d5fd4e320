"""A suite of fine-tuning tasks (`finetune.task=A,B,C`): the list, one planned finetune stage per task, the row's
figures and Avg (pipeline/suite.py), and pipeline.compare's side by side and refusals. No Ray; the run itself is
tests/integration/test_pipeline_cli.py's."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from core.artifacts import ArtifactStore
from core.config import ConfigError, apply_overrides, validate
from core.errors import StageInputError
from pipeline import compare, suite
from pipeline.plan import make_plan, task_key
from pipeline.presets import PRESETS
from stages.finetune.tasks import builtin_tasks, task_list


def test_task_list_expands_the_suite_and_refuses_a_task_named_twice():
    assert task_list("wnut16-ner, lee-sts") == ("wnut16-ner", "lee-sts")
    assert task_list("all") == tuple(builtin_tasks()) and len(builtin_tasks()) >= 4
    assert task_list("/data/rte,all")[0] == "/data/rte"
    with pytest.raises(StageInputError, match="task lee-sts is named twice"):
        task_list("lee-sts,all")
    with pytest.raises(ConfigError, match="an empty task name"):
        validate(apply_overrides(PRESETS["debug"](), ["finetune.task=lee-sts,,wnut16-ner"]))


def test_each_task_is_its_own_finetune_stage_with_the_id_it_has_alone(tmp_path):
    """A task's artifact id is the same in a suite and alone: adding a task to the list leaves the others cached."""
    cfg, store = PRESETS["debug"](), ArtifactStore(tmp_path)
    alone = make_plan(cfg, store, {"raw": "r1", "task": "t2"})[-1]
    plan = make_plan(cfg, store, {"raw": "r1", task_key("a"): "t1", task_key("b"): "t2"})
    tuned = [st for st in plan if st.spec.name == "finetune"]
    assert [st.name for st in tuned] == ["finetune:a", "finetune:b"]
    assert tuned[1].artifact_id == alone.artifact_id != tuned[0].artifact_id
    assert alone.name == "finetune" and tuned[1].object_key("task") == "task:b"


def _sweep(dir_, metric, rows):
    dir_.mkdir()
    table = pd.DataFrame([{"dropout": 0.0, "warmup_steps": 1, "lr": lr, "batch_size": 16, "seed": seed, metric: v}
                          for lr, seed, v in rows])
    table.to_csv(dir_ / "results.csv", index=False)
    return table


def test_a_tasks_row_and_the_average(tmp_path):
    """The champion column is the champion point's seed mean with the seeds' spread (not another point's), the gain
    over scratch the best scratch point's seed mean subtracted; Avg the mean over the tasks that finished."""
    from stages.finetune.tasks import resolve_task

    task = resolve_task("lee-sts")
    art = tmp_path / "art"
    _sweep(art, "dev_pearson", [(1e-3, 0, 0.50), (1e-3, 1, 0.70), (2e-3, 0, 0.10), (2e-3, 1, 0.90)])
    (art / "champion.json").write_text(json.dumps({"dropout": 0.0, "warmup_steps": 1, "lr": 1e-3, "batch_size": 16,
                                                   "seed": 1, "seed_mean": 0.60, "dev_pearson": 0.70}))
    pd.DataFrame([{"dropout": 0.0, "warmup_steps": 1, "lr": 1e-3, "batch_size": 16, "seed": s, "dev_pearson": v}
                  for s, v in ((0, 0.2), (1, 0.3))]).to_csv(art / "results_scratch.csv", index=False)
    row = suite.task_row(task, art, "ran", "deberta-debug-lee-sts v1", {"dev_contamination": "0 of 445 (0.0%)"})
    assert row["champion"] == pytest.approx(0.60) and row["spread"] == pytest.approx(0.10) and row["seeds"] == 2
    assert row["served"] == 0.70 and row["gain_over_scratch"] == pytest.approx(0.35)
    assert row["kind"] == "regression" and row["metric"] == "pearson" and row["baseline"] == 0.0
    assert row["dev_contamination"] == "0 of 445 (0.0%)"
    failed = suite.task_row(resolve_task("rotten-tomatoes-choice"), None, "failed: boom")
    table = suite.make_table([row, {**row, "task": "x", "champion": 0.9}, failed])
    assert table["avg"] == pytest.approx(0.75) and table["avg_over"] == 2 and table["tasks"] == 3
    text = suite.format_table(table)
    assert text.splitlines()[-1].startswith("Avg") and "0.7500" in text and "failed: boom" in text


def test_side_by_side_flags_a_difference_beyond_the_seeds_spread():
    row = {"task": "a", "metric": "accuracy", "champion": 0.60, "spread": 0.01, "seeds": 3}
    first = {"rows": [row, {**row, "task": "b"}], "avg": 0.6}
    second = {"rows": [{**row, "champion": 0.65}, {**row, "task": "b", "champion": 0.61}], "avg": 0.63}
    lines = compare.side_by_side([first, second])
    assert [line["task"] for line in lines] == ["a", "b", "Avg"]
    assert lines[0]["diffs"][0] == (pytest.approx(0.05), "yes") and lines[1]["diffs"][0][1] == "no"
    assert lines[2]["diffs"][0][0] == pytest.approx(0.03)


@pytest.fixture(scope="module")
def store_with_a_run(tmp_path_factory):
    """(a workdir whose sqlite store holds one pipeline run that logged no table, that run's id)."""
    from core.lineage import Lineage

    wd = tmp_path_factory.mktemp("compare") / "wd"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the workdir's own store, whatever another test set
        return wd, Lineage(wd).start("pipeline-debug", {"preset": "debug"}, ["finetune"]).run_id


REFUSALS = [
    (["only-one"], "give two or more runs"),
    (["a1", "a1"], "a1 is given twice"),
    (["a1", "b2", "--workdir", "{wd}/none"], "no MLflow store at"),
    (["nope", "{run}"], "nope: no run of that id"),
    (["models:/x/1", "{run}"], "no registered model 'x'"),
    (["models:/x", "{run}"], "expected models:/NAME/VERSION"),
    (["{run}", "{run}x"], "logged no suite.json"),
]


def test_compare_refuses_bad_input_in_one_line(store_with_a_run, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    wd, run = store_with_a_run
    for argv, fragment in REFUSALS:
        argv = [a.format(wd=wd, run=run) for a in argv]
        rc = compare.main([*argv, *(["--workdir", str(wd)] if "--workdir" not in argv else [])])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], (argv, err)


def test_the_tasks_sweeps_side_by_side_and_the_dry_runs_time(tmp_path):
    """As many sweeps side by side as fill the cluster's trial slots, plus one; `tasks_at_once` caps them without
    changing an artifact id; the dry run's time is the trials' work over the trials at once plus each task's own
    seconds over the sweeps side by side, and unknown for trials the bench did not measure."""
    from stages.finetune import estimates
    from stages.finetune.sweep import sweeps_at_once, trials_at_once
    from stages.finetune.tasks import resolve_task

    cfg = PRESETS["debug"]()
    ft = cfg.finetune  # 2 trials at once per sweep, 1 CPU each
    assert (trials_at_once(ft, 4, 0), sweeps_at_once(ft, 4, 0), sweeps_at_once(ft, 2, 0)) == (4, 3, 2)
    gpu = apply_overrides(cfg, ["finetune.use_gpu=true"]).finetune
    assert (trials_at_once(gpu, 16, 1), sweeps_at_once(gpu, 16, 1)) == (1, 2)
    one = apply_overrides(cfg, ["finetune.tasks_at_once=1"])
    assert sweeps_at_once(one.finetune, 4, 0) == 1
    ids = {"raw": "r1", task_key("a"): "t1", task_key("b"): "t2"}
    store = ArtifactStore(tmp_path)
    assert [s.artifact_id for s in make_plan(one, store, ids)] == [s.artifact_id for s in make_plan(cfg, store, ids)]

    tasks = [resolve_task("lee-sts"), resolve_task("wnut16-ner")]
    basis = {"trial_s_per_example_epoch": 0.01, "task_s": 20.0}
    work = sum(4 * ft.epochs * estimates.examples(t, ft) for t in tasks) * 0.01
    assert estimates.seconds(ft, tasks, 4, 0, basis, at_once=1) == pytest.approx(work / 2 + 2 * 20.0)
    assert estimates.seconds(ft, tasks, 4, 0, basis) == pytest.approx(work / 4 + 20.0)
    lines = estimates.suite_lines(ft, cfg.model, tasks, 1, (4, 0))
    assert lines[0].startswith("  suite: 8 trials in 2 tasks to fine-tune (1 cached); on 4 CPUs and 0 GPUs 4 trials")
    assert lines[-1].startswith("  time: about "), lines
    other = PRESETS["cpu-small"]()
    assert "time: unknown for these trials" in estimates.suite_lines(other.finetune, other.model, tasks, 0, (4, 0))[-1]
    assert "not estimated" in estimates.suite_lines(ft, cfg.model, tasks, 0, None)[0]
