"""A suite of tasks fine-tuned side by side against the same tasks one after another, in one run.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.suite'     # ~15 min on 2 busy cores

Pretrains the debug preset once (`--pretrain-steps`), then fine-tunes the same built-in tasks (`--tasks`, one of each
kind) from its hf/ export twice on a local Ray of `--num-cpus` CPUs (default: the machine's cores), each a
`python -m pipeline.run --pretrained HF --task A,B,C,D` in a fresh workdir with the same settings but
`finetune.tasks_at_once`: 1 (one task's sweep after another, as before the suite shared the cluster) and 0 (side by
side, as many as the cluster holds: `stages.finetune.sweep.sweeps_at_once`). Reports each
run's wall time (the process, and the finetune stages' span from their MLflow runs), the ratio, and whether
both chose the same champions. From the one-after-another run it measures the dry run's time basis
(`stages.finetune.estimates`): a trial's seconds per example-epoch (its MLflow run's span over its epochs x the
task's examples) and a task's seconds outside its trials (its stage seconds less its trials' share), and sets the
estimate that basis gives for the side-by-side run beside what it took. Writes bench/results/suite.json (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, RESULTS, command_line, emit, load_average

TASKS = ("lee-sts", "wnut16-ner", "rotten-tomatoes-choice", "rotten-tomatoes")
"""A regression, a token, a choice and a classification task: the four kinds' built-ins."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS), help="built-in tasks, comma-separated")
    p.add_argument("--pretrain-steps", type=int, default=100)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-train-examples", type=int, default=500)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count(),
                   help="Ray CPUs (default: this machine's cores, the room a local Ray has without ray.num_cpus)")
    p.add_argument("--json", type=Path, default=RESULTS / "suite.json")
    return p.parse_args(argv)


def pipeline(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    started = time.time()
    res = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"pipeline.run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res, time.time() - started


def finetune_runs(workdir: Path, stdout: str) -> dict[str, dict]:
    """task -> its stage run's span, seconds and artifact, and its trials' spans (s), from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    from core.lineage import TAG_ARTIFACT, default_tracking_uri

    parent = re.search(r"\(parent run ([0-9a-f]+)\)", stdout).group(1)
    client = MlflowClient(default_tracking_uri(workdir))
    exp = client.get_run(parent).info.experiment_id

    def children(run_id: str):
        return client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'", max_results=1000)

    out = {}
    for run in children(parent):
        if run.data.tags.get("pipeline.stage") != "finetune":
            continue
        task = run.data.params["task.name"]
        out[task] = {"start": run.info.start_time / 1e3, "end": run.info.end_time / 1e3,
                     "stage_s": run.data.metrics["stage_seconds"], "artifact": run.data.tags[TAG_ARTIFACT],
                     "trials_s": [(t.info.end_time - t.info.start_time) / 1e3 for t in children(run.info.run_id)]}
    return out


def one_mode(hf: Path, tasks: str, sets: dict, tasks_at_once: int, root: Path) -> dict:
    workdir = root / f"at-once-{tasks_at_once}"
    load = load_average()
    res, wall = pipeline(["--pretrained", str(hf), "--task", tasks, "--workdir", str(workdir),
                          *[a for k, v in {**sets, "finetune.tasks_at_once": tasks_at_once}.items()
                            for a in ("--set", f"{k}={v}")]])
    runs = finetune_runs(workdir, res.stdout)
    champions = {t: json.loads((workdir / "artifacts" / "finetune" / r["artifact"] / "champion.json").read_text())
                 for t, r in runs.items()}
    return {"tasks_at_once": tasks_at_once, "load_average_before": load, "wall_s": round(wall, 1),
            "finetune_span_s": round(max(r["end"] for r in runs.values()) - min(r["start"] for r in runs.values()), 1),
            "stages": {t: {"stage_s": round(r["stage_s"], 1), "trials": len(r["trials_s"]),
                           "trial_s_sum": round(sum(r["trials_s"]), 1), "artifact": r["artifact"],
                           "start_s": round(r["start"] - min(x["start"] for x in runs.values()), 1)}
                       for t, r in runs.items()},
            "champions": {t: {k: c[k] for k in ("seed_mean", "lr", "dropout", "seed", "best_epoch")}
                          for t, c in champions.items()}}


def measured_basis(serial: dict, cfg, refs: dict, shape: dict, cpus: int, gpus: int) -> dict:
    """The dry run's figures from the one-after-another run (module docstring)."""
    from stages.finetune.estimates import examples
    from stages.finetune.sweep import trials_at_once

    stages = serial["stages"]
    work = sum(s["trials"] * cfg.epochs * examples(refs[t], cfg) for t, s in stages.items())
    at_once = min(trials_at_once(cfg, cpus, gpus), cfg.max_concurrent_trials)
    task_s = [s["stage_s"] - s["trial_s_sum"] / at_once for s in stages.values()]
    return {"preset": "debug", "shape": shape, "machine": f"{os.cpu_count()} cores, {cpus} Ray CPUs",
            "trial_s_per_example_epoch": round(sum(s["trial_s_sum"] for s in stages.values()) / work, 6),
            "task_s": round(sum(task_s) / len(task_s), 1)}


def main(argv=None) -> int:
    from core.artifacts import code_version
    from core.config import apply_overrides
    from pipeline.presets import PRESETS
    from stages.finetune import estimates
    from stages.finetune.tasks import resolve_task

    args = parse_args(argv)
    sets = {"ray.dashboard": "false", "ray.num_cpus": args.num_cpus, "finetune.epochs": args.epochs,
            "finetune.max_train_examples": args.max_train_examples}
    cfg = apply_overrides(PRESETS["debug"](), [f"{k}={v}" for k, v in sets.items()])
    cpus, gpus = cfg.ray.num_cpus, 0
    started, load = time.time(), load_average()
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        pre, _ = pipeline(["--until", "pretrain", "--workdir", f"{tmp}/pre", "--set", "ray.dashboard=false",
                           "--set", f"pretrain.max_steps={args.pretrain_steps}"])
        (art,) = re.findall(r"^  pretrain\s+[0-9a-f]{16}  \(ran\)  (\S+)$", pre.stdout, re.M)
        suite = one_mode(Path(art) / "hf", args.tasks, sets, 0, Path(tmp))
        serial = one_mode(Path(art) / "hf", args.tasks, sets, 1, Path(tmp))
    refs = {t: resolve_task(t) for t in args.tasks.split(",")}
    basis = measured_basis(serial, cfg.finetune, refs, estimates.trial_shape(cfg.finetune, cfg.model), cpus, gpus)
    tasks = list(refs.values())
    predicted = {"one_after_another_s": round(estimates.seconds(cfg.finetune, tasks, cpus, gpus, basis, 1), 1),
                 "side_by_side_s": round(estimates.seconds(cfg.finetune, tasks, cpus, gpus, basis), 1)}
    report = {
        "bench": "suite", "command": command_line(), "commit": code_version()[:7], "load_average": load,
        "preset": "debug", "tasks": args.tasks.split(","), "trials_per_task": suite["stages"][tasks[0].name]["trials"],
        "epochs": args.epochs, "max_train_examples": args.max_train_examples, "ray_cpus": cpus,
        "max_concurrent_trials": cfg.finetune.max_concurrent_trials,
        "sweeps_side_by_side": min(len(tasks), estimates.sweeps_at_once(cfg.finetune, cpus, gpus)),
        "side_by_side": suite, "one_after_another": serial,
        "wall_ratio": round(suite["wall_s"] / serial["wall_s"], 3),
        "finetune_span_ratio": round(suite["finetune_span_s"] / serial["finetune_span_s"], 3),
        "same_artifacts": {t: s["artifact"] for t, s in suite["stages"].items()} ==
                          {t: s["artifact"] for t, s in serial["stages"].items()},
        "same_champions": suite["champions"] == serial["champions"],
        "basis": basis, "estimate": predicted, "bench_s": round(time.time() - started, 1),
    }
    lines = [f"{'mode':<18}{'wall s':>8}{'finetune span s':>17}  stages (s, start offset)"]
    for name, r in (("side by side", suite), ("one after another", serial)):
        per = ", ".join(f"{t} {s['stage_s']:.0f} @{s['start_s']:.0f}" for t, s in r["stages"].items())
        lines.append(f"{name:<18}{r['wall_s']:>8.0f}{r['finetune_span_s']:>17.0f}  {per}")
    lines.append(f"side by side / one after another: wall {report['wall_ratio']:.2f}x, finetune span "
                 f"{report['finetune_span_ratio']:.2f}x; same champions: {report['same_champions']}")
    lines.append(f"dry-run basis: {basis['trial_s_per_example_epoch'] * 1e3:.3g} ms per example-epoch, "
                 f"{basis['task_s']:.0f} s per task; its estimate of the side-by-side span "
                 f"{predicted['side_by_side_s']:.0f} s (measured {suite['finetune_span_s']:.0f} s)")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
