"""Pretraining measured in task terms: the debug preset pretrained on the built-in news corpus for several thousand
steps with a probe (`pretrain.probes`) on a token task at a 200-label budget, 3 seeds: the probe's dev entity F1
at every probe step, step 0 being the same model from its initial weights (the from-scratch control), beside the
validation MLM loss.

The task: the built-in WNUT-2016 tweets tagged by `bench.served.tweet_names_dir`'s rule (handles, capitalised runs;
on WNUT's own tags the debug model tags no entity at any step, `bench/results/served.json`).

    unshare --net sh -c 'ip link set lo up && nice -n 10 .venv/bin/python -m bench.probes'   # ~1 h on 2 cores

Runs `python -m pipeline.run --preset debug --until pretrain` with the probe settings in its own workdir (stages
already there are reused), then reads the pretrain stage's MLflow run (`probe.<task>.f1`, `..._std`, `val_loss`)
and its artifact's probes.json (each seed's F1); copies the run's probes.png to bench/results/probes.png. With
`--sentence`, also the sentence task (rotten-tomatoes) with all its labels, at step 0 and the last step only, by
the same probe trials (`stages.pretrain.probes.probe_trial`) on the initial and the final weights.

Prints one JSON object (also written to --json, by default bench/results/probes.json) and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, RESULTS, command_line, comma_ints, emit, load_average
from core.lineage import EXPERIMENT, default_tracking_uri


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.presets import debug

    debug_pretrain = debug().pretrain
    p = argparse.ArgumentParser(prog="python -m bench.probes", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-probes"))
    p.add_argument("--steps", type=int, default=4_000)
    p.add_argument("--interval", type=int, default=1_000)
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--max-steps", type=int, default=debug_pretrain.probe_max_steps, help="pretrain.probe_max_steps")
    p.add_argument("--patience", type=int, default=debug_pretrain.probe_patience, help="pretrain.probe_patience")
    p.add_argument("--sentence", action="store_true", help="also rotten-tomatoes with all its labels, step 0 and last")
    p.add_argument("--json", type=Path, default=RESULTS / "probes.json")
    return p.parse_args(argv)


def pipeline_argv(args: argparse.Namespace, task_dir: Path) -> list[str]:
    sets = {"pretrain.max_steps": args.steps, "pretrain.probes": task_dir, "pretrain.probe_interval": args.interval,
            "pretrain.probe_examples": args.examples, "pretrain.probe_max_steps": args.max_steps,
            "pretrain.probe_patience": args.patience,
            "pretrain.probe_seeds": ",".join(map(str, args.seeds))}
    return ["-m", "pipeline.run", "--preset", "debug", "--workdir", str(args.workdir), "--until", "pretrain",
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]


def pretrain_run(workdir: Path):
    import mlflow

    client = mlflow.MlflowClient(default_tracking_uri(workdir))
    runs = client.search_runs(
        [client.get_experiment_by_name(EXPERIMENT).experiment_id],
        filter_string="tags.`pipeline.stage` = 'pretrain' and tags.`pipeline.status` = 'finished'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished pretrain run in {workdir}; the pipeline run above failed")
    return client, runs[0]


def history(client, run, key: str) -> dict[int, float]:
    """step -> the value first logged at that step."""
    out: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
        out.setdefault(m.step, m.value)
    return out


def sentence_probe(args: argparse.Namespace, artifact: Path) -> dict:
    """rotten-tomatoes, every train label, at step 0 (initial weights) and the last step (the artifact's weights)."""
    import dataclasses

    import numpy as np
    import ray

    from deberta import checkpoint
    from pipeline.presets import debug
    from stages.finetune.data import backbone_weights, prepare_data
    from stages.finetune.trial import TrialSetup
    from stages.pretrain import probes
    from stages.pretrain.objectives import objective_for

    cfg = dataclasses.replace(debug().pretrain, probes=("rotten-tomatoes",), probe_examples=None,
                              probe_batch_size=32, probe_seeds=args.seeds)
    [task] = probes.resolve_probes(cfg)
    model = checkpoint.load_config(artifact / "model")
    data = prepare_data(task, artifact / "tokenizer", probes.finetune_config(cfg, task.name))
    ft = probes.finetune_config(cfg, task.name, len(data[0]))
    setup = TrialSetup(model, task.num_labels, task.kind, task.metric, ft)
    weights = {0: probes.initial_backbone(objective_for(cfg), model, cfg.seed),
               args.steps: backbone_weights(artifact / "model")}
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             object_store_memory=1 << 30)
    trial = ray.remote(probes.probe_trial).options(num_cpus=1)
    refs = {(step, seed): trial.remote(setup, {"lr": cfg.probe_lr[0], "seed": seed, "dropout": 0.1,
                                               "batch_size": cfg.probe_batch_size,
                                               "warmup_steps": cfg.probe_warmup_steps}, data, w, cfg.probe_patience)
            for step, w in weights.items() for seed in args.seeds}
    values = {k: ray.get(r)["value"] for k, r in refs.items()}
    ray.shutdown()
    out = {"task": task.name, "metric": task.metric, "train_rows": len(data[0]), "dev_rows": len(data[1]),
           "epochs": ft.epochs, "lr": cfg.probe_lr[0], "batch_size": cfg.probe_batch_size}
    for step in weights:
        v = np.array([values[(step, s)] for s in args.seeds])
        out[f"step{step}"] = {"mean": round(float(v.mean()), 4), "std": round(float(v.std(ddof=1)), 4),
                              "per_seed": [round(float(x), 4) for x in v]}
    out["gain"] = round(out[f"step{args.steps}"]["mean"] - out["step0"]["mean"], 4)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.served import tweet_names_dir

    args.workdir.mkdir(parents=True, exist_ok=True)
    task_dir = args.workdir / "task" / "tweet-names"
    if not task_dir.is_dir():
        shutil.rmtree(task_dir.parent, ignore_errors=True)
        tweet_names_dir(task_dir.parent)
    started = time.time()
    subprocess.run([sys.executable, *pipeline_argv(args, task_dir)], cwd=REPO, check=True)
    wall = time.time() - started
    client, run = pretrain_run(args.workdir)
    key = "probe.tweet-names.f1"
    mean, std, val = history(client, run, key), history(client, run, key + "_std"), history(client, run, "val_loss")
    artifact = args.workdir / "artifacts" / "pretrain" / run.data.tags["pipeline.artifact_id"]
    ledger = json.loads((artifact / "probes.json").read_text())["steps"]
    shutil.copy2(artifact / "probes.png", RESULTS / "probes.png")
    curve = [{"step": s, "f1_mean": round(mean[s], 4), "f1_std": round(std[s], 4),
              "f1_per_seed": [round(v, 4) for v in ledger[str(s)]["tweet-names"]["per_seed"].values()],
              "val_loss": round(val[s], 4) if s in val else None} for s in sorted(mean)]
    first, last = curve[0], curve[-1]
    gain = last["f1_mean"] - first["f1_mean"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    report = {
        "bench": "probes", "command": command_line(), "commit": head.stdout.strip() or None,
        "load_average": load_average(), "preset": "debug", "pretrain_steps": args.steps,
        "probe_interval": args.interval, "label_budget": args.examples, "seeds": list(args.seeds),
        "probe_max_steps": args.max_steps,
        "probe_patience": args.patience, "task": "tweet-names", "metric": "dev entity F1", "wall_s": round(wall, 1),
        "pretrain_stage_s": round(run.data.metrics.get("stage_seconds", float("nan")), 1),
        "curve": curve, "scratch": first, "last": last, "gain_over_scratch": round(gain, 4),
        "larger_spread": round(max(first["f1_std"], last["f1_std"]), 4),
        "gain_exceeds_spread": bool(gain > max(first["f1_std"], last["f1_std"])),
        "every_last_seed_above_every_scratch_seed": bool(min(last["f1_per_seed"]) > max(first["f1_per_seed"])),
        "plot": "bench/results/probes.png",
    }
    if args.sentence:
        report["sentence_all_labels"] = sentence_probe(args, artifact)
    lines = [f"debug preset, {args.steps} MLM steps on the built-in news corpus; probe tweet-names at "
             f"{args.examples} labels, {len(args.seeds)} seeds, up to {args.max_steps} steps",
             f"{'step':>6} {'val MLM loss':>13} {'dev entity F1':>16}"]
    for row in curve:
        vl = f"{row['val_loss']:.3f}" if row["val_loss"] is not None else "-"
        lines.append(f"{row['step']:>6} {vl:>13} {row['f1_mean']:>9.4f} ± {row['f1_std']:.4f}")
    lines.append(f"gain over scratch {gain:+.4f} (spread {report['larger_spread']:.4f})")
    if args.sentence:
        s = report["sentence_all_labels"]
        lines.append(f"rotten-tomatoes, all {s['train_rows']} labels: step 0 {s['step0']['mean']:.4f} ± "
                     f"{s['step0']['std']:.4f}, step {args.steps} {s[f'step{args.steps}']['mean']:.4f} ± "
                     f"{s[f'step{args.steps}']['std']:.4f}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
