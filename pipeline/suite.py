"""The row of a run: each fine-tuned task's champion beside its baseline, and their average.

How a pretrained checkpoint is judged in the DeBERTa paper (Tables 2, 3 and 5) is a row of scores over a suite of
tasks and their average ("Avg"). Every run that fine-tunes (`finetune.task=A,B,C`, or one task) ends with that
row: printed in the run's summary and logged on its top-level MLflow run as `suite.json`, `suite.csv` and
`suite.png` (one bar per task, its baseline marked), with the metrics `suite.<task>` and `suite.avg`.
`python -m pipeline.compare` puts the rows of several runs side by side from there.

Columns (one row per task): task, kind, metric (the task's selection metric on dev), champion (the champion grid
point's mean over its seeds, the selection's own figure), spread (the standard deviation over those seeds, ddof=0;
0 with one seed), seeds, served (the registered model's own dev figure: the best seed at its best epoch),
baseline (the task's rule of thumb: majority class, train mean, most frequent tag), gain_over_scratch (with
`finetune.control=scratch`: champion minus the from-scratch sweep's best seed mean), dev_contamination (the
registry version's `dev_contamination` tag when the finetune stage measured it; blank otherwise), model (the
registry version), status (ran, cached or the failure).

Avg is the unweighted mean of the champion column over the tasks that finished, as GLUE's and the paper's "Avg"
average task scores as they are: every selection metric here (accuracy, F1, Pearson's r) is a fraction of 1, so no
task's scale outweighs another's (a correlation may be negative; it counts as it is).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("task", "kind", "metric", "champion", "spread", "seeds", "served", "baseline", "gain_over_scratch",
           "dev_contamination", "model", "status")
TABLE_FILE, CSV_FILE, PLOT_FILE = "suite.json", "suite.csv", "suite.png"


def seed_figures(results, champion: dict[str, Any], metric: str) -> tuple[float, float, int]:
    """(mean, spread, seeds) of `metric` over the seeds of the champion's grid point in results.csv."""
    from stages.finetune.sweep import GRID_KEYS

    at = results
    for key in GRID_KEYS:
        at = at[at[key] == champion[key]]
    values = at[metric].astype(float)
    return float(values.mean()), float(values.std(ddof=0)), len(values)


def task_row(task, art_dir: Path | None, status: str, model: str = "", tags: dict[str, str] | None = None
             ) -> dict[str, Any]:
    """One task's row from its finetune artifact (champion.json, results.csv, results_scratch.csv); `art_dir`
    None (the task failed): its name, kind, metric and baseline alone."""
    import pandas as pd

    baseline = task.kind.baseline(task)[0]
    row = dict.fromkeys(COLUMNS, "") | {"task": task.name, "kind": task.problem, "metric": task.metric,
                                        "baseline": baseline, "status": status, "model": model}
    if art_dir is None:
        return row
    metric = f"dev_{task.metric}"
    champion = json.loads((art_dir / "champion.json").read_text())
    _, spread, seeds = seed_figures(pd.read_csv(art_dir / "results.csv"), champion, metric)
    row.update(champion=float(champion["seed_mean"]), spread=spread, seeds=seeds, served=float(champion[metric]))
    if (art_dir / "results_scratch.csv").is_file():
        from stages.finetune.sweep import pick_champion

        scratch = pick_champion(pd.read_csv(art_dir / "results_scratch.csv"), metric)["seed_mean"]
        row["gain_over_scratch"] = float(champion["seed_mean"]) - float(scratch)
    row["dev_contamination"] = (tags or {}).get("dev_contamination", "")
    return row


def average(rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """(Avg, tasks averaged): the unweighted mean of the finished tasks' champion figures (module docstring)."""
    scores = [r["champion"] for r in rows if isinstance(r["champion"], float)]
    return (sum(scores) / len(scores) if scores else None), len(scores)


def make_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    avg, n = average(rows)
    return {"columns": list(COLUMNS), "rows": rows, "avg": avg, "avg_over": n, "tasks": len(rows)}


def _cell(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_table(table: dict[str, Any]) -> str:
    """The row as text: one line per task, then Avg."""
    head = f"{'task':<24} {'kind':<14} {'metric':<9} {'champion':>17} {'served':>7} {'baseline':>8} " \
           f"{'vs scratch':>10}  contamination  status"
    lines = [head]
    for r in table["rows"]:
        champ = f"{_cell(r['champion'])} ± {_cell(r['spread'])} ({r['seeds']})" if r["seeds"] != "" else ""
        gain = f"{r['gain_over_scratch']:+.4f}" if isinstance(r["gain_over_scratch"], float) else ""
        lines.append(f"{r['task']:<24} {r['kind']:<14} {r['metric']:<9} {champ:>17} {_cell(r['served']):>7} "
                     f"{_cell(r['baseline']):>8} {gain:>10}  {r['dev_contamination'] or '-':<13}  "
                     f"{r['status']}{' ' + r['model'] if r['model'] else ''}")
    avg = "-" if table["avg"] is None else f"{table['avg']:.4f}"
    lines.append(f"{'Avg':<24} {'':<14} {'':<9} {avg:>17}   (unweighted mean of {table['avg_over']} of "
                 f"{table['tasks']} tasks' champions)")
    return "\n".join(lines)


def plot(table: dict[str, Any], path: Path, title: str) -> None:
    """One bar per task (champion, the seeds' spread as its error bar), its baseline marked, Avg a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 1.5), 4.0))
    ax.bar(xs, [r["champion"] if isinstance(r["champion"], float) else 0.0 for r in rows],
           yerr=[r["spread"] if isinstance(r["spread"], float) else 0.0 for r in rows], color="tab:blue",
           capsize=4, label="champion (mean over seeds)")
    ax.scatter(xs, [r["baseline"] for r in rows], marker="_", s=900, color="black", zorder=3, label="baseline")
    if table["avg"] is not None:
        ax.axhline(table["avg"], color="tab:orange", linestyle="--", label=f"Avg {table['avg']:.3f}")
    ax.set_xticks(list(xs), [f"{r['task']}\n{r['metric']}" + ("" if r["champion"] != "" else "\n(failed)")
                             for r in rows], fontsize=8)
    ax.set_ylabel("dev metric")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(table: dict[str, Any], out: Path, title: str) -> list[Path]:
    """suite.json, suite.csv and suite.png under `out`; their paths."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE_FILE).write_text(json.dumps(table, indent=2) + "\n")
    frame = pd.DataFrame(table["rows"], columns=list(COLUMNS))
    avg = dict.fromkeys(COLUMNS, "") | {"task": "Avg", "champion": table["avg"] if table["avg"] is not None else ""}
    pd.concat([frame, pd.DataFrame([avg])]).to_csv(out / CSV_FILE, index=False)
    plot(table, out / PLOT_FILE, title)
    return [out / TABLE_FILE, out / CSV_FILE, out / PLOT_FILE]


def report(plan: list, objects: dict[str, Any], store, parent, preset: str, outcome, scratch: Path) -> str:
    """The run's table over its finetune stages (`finetune:<task>` for each of several): each finished task's row
    from its artifact and registry version, a failed task's from its task alone; logged on `parent` (the run's
    top-level MLflow run) and returned as text for the summary ("" when the run fine-tunes nothing)."""
    from core.registry import champion_version

    rows = []
    for st in (st for st in plan if st.spec.name == "finetune"):
        task = objects[st.object_key("task")]
        how = outcome.artifacts.get(st.name, ("", ""))[1]
        if not how:
            rows.append(task_row(task, None, "failed: " + outcome.failed.get(st.name, "not run")[:200]))
            continue
        name = f"deberta-{preset}-{task.name}"
        version, tags = champion_version(parent.tracking_uri, name, st.artifact_id)
        art = store.find("finetune", st.artifact_id)
        rows.append(task_row(task, art.path, how, f"{name} v{version}" if version else "", tags))
    if not rows:
        return ""
    table = make_table(rows)
    for path in write(table, scratch, f"{preset}: {len(rows)} task(s), run {parent.run_id}"):
        parent.log_artifact(path)
    parent.log_metrics({**{f"suite.{r['task']}": r["champion"] for r in rows if isinstance(r["champion"], float)},
                        **({"suite.avg": table["avg"]} if table["avg"] is not None else {})})
    return format_table(table)
