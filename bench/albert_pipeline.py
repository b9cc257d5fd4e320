"""ALBERT's options through the whole pipeline: E = 128, every layer shared, sentence-order prediction, on the debug
preset with its 2 workers, trained long enough for SOP to leave chance (`bench.albert`: from ~1,500 steps).

Runs `python -m pipeline.run` in its own workdir (stages already there are reused, so a rerun only reads them), then
reads the stages' MLflow runs: the validation SOP accuracy at every evaluation with the number of sentence pairs it
counts, chance's two-sigma band for that number, the validation MLM loss, and the champion fine-tuned from the
pretrained model against the task's majority baseline.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.albert_pipeline'   # ~10 min on 2 cores

Prints one JSON object (also written to --json) and a table; never asserted in tests.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, RESULTS, emit
from core.lineage import EXPERIMENT, default_tracking_uri


def pipeline_argv(args: argparse.Namespace) -> list[str]:
    sets = {"model.embedding_size": 128, "model.share_layers": "all", "tokenize.segment_pairs": "true",
            "pretrain.sop": "true", "pretrain.max_steps": args.steps, "pretrain.lr": args.lr,
            "pretrain.eval_batches": args.eval_batches}
    return ["-m", "pipeline.run", "--preset", "debug", "--workdir", str(args.workdir),
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]


def latest_run(client, stage: str, workdir: Path):
    runs = client.search_runs(
        [client.get_experiment_by_name(EXPERIMENT).experiment_id],
        filter_string=f"tags.`pipeline.stage` = '{stage}' and tags.`pipeline.status` = 'finished'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished {stage} run in {workdir}; the pipeline run above failed")
    return runs[0]


def read(workdir: Path) -> dict:
    import mlflow

    client = mlflow.MlflowClient(default_tracking_uri(workdir))  # where the pipeline run logged
    pretrain, finetune = latest_run(client, "pretrain", workdir), latest_run(client, "finetune", workdir)

    def history(key: str) -> dict[int, float]:
        """step -> value as the loop logged it (the stage logs its final metrics again at step 0: kept out)."""
        out: dict[int, float] = {}
        for m in sorted(client.get_metric_history(pretrain.info.run_id, key), key=lambda m: m.timestamp):
            out.setdefault(m.step, m.value)
        return out

    sop, mlm, pairs = history("val_sop_accuracy"), history("val_mlm_loss"), history("val_sop_pairs")
    n = int(max(pairs.values())) if pairs else 0
    sigma = math.sqrt(0.25 / n) if n else float("nan")  # binomial standard deviation of a coin's accuracy
    curve = [{"step": s, "val_mlm_loss": round(mlm[s], 4), "val_sop_accuracy": round(sop[s], 4),
              "sigmas_above_chance": round((sop[s] - 0.5) / sigma, 2)} for s in sorted(sop)]
    above = [row["step"] for row in curve if row["sigmas_above_chance"] > 2]
    stays = next((row["step"] for i, row in enumerate(curve)
                  if all(r["sigmas_above_chance"] > 2 for r in curve[i:])), None)
    ft = finetune.data.metrics
    metric = next(k for k in ft if k.startswith("best_dev_") and not k.endswith("_seed_mean"))
    return {
        "validation_pairs": n, "chance": 0.5,
        "chance_two_sigma": [round(0.5 - 2 * sigma, 4), round(0.5 + 2 * sigma, 4)],
        "curve": curve, "first_step_above_two_sigma": above[0] if above else None,
        "above_two_sigma_from_step": stays,
        "final": curve[-1] if curve else None,
        "stage_seconds": {"pretrain": round(pretrain.data.metrics["stage_seconds"], 1),
                          "finetune": round(finetune.data.metrics["stage_seconds"], 1)},
        "pretrain_tags": {k: v for k, v in pretrain.data.tags.items() if k.startswith("pipeline.")},
        "finetune": {"metric": metric.removeprefix("best_"), "champion": round(ft[metric], 4),
                     "majority_baseline": round(ft.get("majority_baseline", float("nan")), 4),
                     "task": finetune.data.params.get("finetune.task")},
    }


def table(report: dict) -> str:
    lines = [f"validation SOP over {report['validation_pairs']} sentence pairs; chance 0.5, two sigma "
             f"{report['chance_two_sigma'][0]:.3f}-{report['chance_two_sigma'][1]:.3f}",
             "| step | val MLM loss | val SOP accuracy | sigmas above chance |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['val_mlm_loss']:.3f} | {r['val_sop_accuracy']:.3f} | "
              f"{r['sigmas_above_chance']:+.1f} |" for r in report["curve"]]
    ft = report["finetune"]
    lines.append(f"above two sigma from step {report['above_two_sigma_from_step']}; fine-tuned on {ft['task']}: "
                 f"{ft['metric']} {ft['champion']:.3f} (majority baseline {ft['majority_baseline']:.3f}); "
                 f"stages pretrain {report['stage_seconds']['pretrain']:.0f} s, finetune "
                 f"{report['stage_seconds']['finetune']:.0f} s (this invocation {report['pipeline_seconds']:.0f} s: "
                 f"finished stages are reused)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=REPO / "workdir" / "bench-albert-pipeline")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-batches", type=int, default=96,
                   help="per worker, of the preset's 8 rows: 96 x 8 x 2 covers the debug corpus's 1,548 "
                        "validation rows")
    p.add_argument("--json", type=Path, default=RESULTS / "albert_pipeline.json")
    args = p.parse_args(argv)
    command = [sys.executable, *pipeline_argv(args)]
    print("running:", " ".join(command[1:]), file=sys.stderr)
    started = time.time()
    subprocess.run(command, cwd=REPO, check=True)
    report = {"command": "python -m bench.albert_pipeline " + " ".join(sys.argv[1:] if argv is None else argv),
              "pipeline": " ".join(command[1:]), "pipeline_seconds": round(time.time() - started, 1),
              **read(args.workdir)}
    emit(report, args.json, table(report))


if __name__ == "__main__":
    main()
