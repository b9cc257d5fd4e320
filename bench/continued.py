"""Domain adaptation: a model pretrained on news, continued on movie reviews, fine-tuned on their sentiment.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.continued'          # about an hour on 2 cores
    ... -m bench.continued --steps 40 --adapt-steps 8 --seeds 0 --ft-examples 200 --ft-epochs 1  # a smoke run

1. Data: the `cpu-small` preset's corpus, vocab and tokenize stages on the built-in news corpus (`pipeline.run
   --until tokenize`, Ray).
2. The "released" model: `cpu-small`'s 4 x 256 MLM pretrained on news for `--steps` steps - the stage's objective and
   training step (`stages.pretrain.loop.train_step`) on a plain torch engine, as bench.objectives does - with its
   backbone kept at `--snapshots` fractions of the run for the curve of dev accuracy against pretraining steps, and
   the last state exported as an HF directory (`deberta.hf.save_pretrained`).
3. Adaptation, through the pipeline: `pipeline.run --preset cpu-small --corpus <the task's unlabelled train text>
   --set pretrain.init=<that directory>` for `--adapt-steps` steps (task-adaptive pretraining: the task's own
   training sentences, labels dropped; its dev sentences are not used). Its metrics.json gives the validation MLM
   loss on the review domain before (`val_loss_released`: the released function; `initial_val_loss`: with the EMD
   started as continuing starts it) and after.
4. Fine-tuning (`stages.finetune.trial.run_epochs`, the finetune stage's loop): rotten-tomatoes from random
   initialisation (step 0), each snapshot, and the adapted backbone, one hyper-parameter point, `--seeds` seeds,
   the same budget for all; a trial's score is its best epoch's dev accuracy. Beside them the baseline a
   practitioner tries first: TF-IDF + logistic regression (scikit-learn), best of a small grid on the same split.

Writes bench/results/continued.json (and .png: loss and dev accuracy against pretraining steps), prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import comma_floats, comma_ints, emit, process_pool

REPO = Path(__file__).resolve().parents[1]
PRESET = "cpu-small"
RESUME_EVERY = 250  # news pretraining steps between progress lines and resumable states (~60 MB, ~2.5 min)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.continued", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/continued-bench"))
    p.add_argument("--steps", type=int, default=1_200, help="pretraining steps on news (batch --batch)")
    p.add_argument("--snapshots", type=comma_floats, default=(0.0, 0.25, 0.5, 1.0),
                   help="fractions of --steps whose backbone is fine-tuned (0 = random initialisation)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--adapt-steps", type=int, default=300, help="continued pretraining steps on the reviews")
    p.add_argument("--adapt-lr", type=float, default=3e-4)
    p.add_argument("--seeds", type=comma_ints, default=(0, 1, 2))
    p.add_argument("--ft-lr", type=float, default=2e-4)
    p.add_argument("--ft-batch", type=int, default=32)
    p.add_argument("--ft-epochs", type=int, default=3)
    p.add_argument("--ft-warmup", type=int, default=50)
    p.add_argument("--ft-dropout", type=float, default=0.1)
    p.add_argument("--ft-seq-len", type=int, default=64)
    p.add_argument("--ft-examples", type=int, default=2_000)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "continued.json",
                   help="the report (its plot: the same name, .png)")
    p.add_argument("--render", action="store_true", help="only print the table and draw the plot of --json")
    return p.parse_args(argv)


def pipeline(args: list[str]) -> str:
    """`python -m pipeline.run ARGS` (this process's network namespace); its stdout, or SystemExit with its end."""
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--preset", PRESET, *args], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    if res.returncode != 0:
        raise SystemExit(f"error: pipeline.run {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout


def artifacts(stdout: str) -> dict[str, Path]:
    return {m.group(1): Path(m.group(2))
            for m in re.finditer(r"^  (\w+) +\w+  \((?:ran|cached)\)  (\S+)$", stdout, re.M)}


# ------------------------------------------------------------------------------------------------- pretraining

def pretrain(args, tok_dir: Path, vocab_dir: Path, model) -> tuple[dict[str, Any], dict[int, dict], dict]:
    """`--steps` of the stage's MLM step on news; (report, {step: backbone}, final state dict).

    The result is kept in `--workdir`/news-pretrain/KEY (KEY: the tokenize artifact and every pretraining option),
    so a rerun with other fine-tuning options reuses it; it is written under KEY.tmp and renamed when complete.
    A run stopped on the way (killed, or the machine's session ended) resumes from KEY.tmp/resume.pt, written
    every RESUME_EVERY steps: weights, optimizer and schedule - masks and dropout are seeded by the step
    (`train_step`), so the resumed run takes the same steps as an uninterrupted one. A long run can thus be
    gathered over several sittings.
    """
    import hashlib

    import torch
    from safetensors.numpy import load_file, save_file

    key = hashlib.sha256(json.dumps({"tokenize": tok_dir.name, "model": repr(model), "steps": args.steps,
                                     "batch": args.batch, "lr": args.lr, "warmup": args.warmup,
                                     "snapshots": list(args.snapshots)}, sort_keys=True).encode()).hexdigest()[:16]
    done, partial = args.workdir / "news-pretrain" / key, args.workdir / "news-pretrain" / f"{key}.tmp"
    if (done / "report.json").exists():
        print(f"pretraining: reusing {done}", file=sys.stderr, flush=True)
        snapshots = {int(f.stem.split("-")[1]): load_file(f) for f in done.glob("step-*.safetensors")}
        final = {k: torch.from_numpy(v) for k, v in load_file(done / "final.safetensors").items()}
        return json.loads((done / "report.json").read_text()), snapshots, final
    resume = partial / "resume.pt"
    if not resume.exists():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    from bench.objectives import load_sequences
    from core.config import PretrainConfig
    from core.tokenizer import Tokenizer
    from stages.pretrain import objective_for
    from stages.pretrain.loop import optim_spec, train_step, validation_sums
    from training.engine import build

    torch.set_num_threads(args.procs * args.threads)
    cfg = PretrainConfig(num_workers=1, micro_batch_size=args.batch, train_batch_size=args.batch, lr=args.lr,
                         warmup_steps=args.warmup, max_steps=args.steps)
    objective = objective_for(cfg)
    tok = Tokenizer.load(vocab_dir)
    train, val = load_sequences(tok_dir, "train"), load_sequences(tok_dir, "validation")
    factory, _ = objective.build_model(model)
    engine = build(factory, optim_spec(cfg), seed=cfg.seed)
    masker = objective.masker(len(tok), tok.mask_id, list(tok.special_ids.values()),
                              torch.from_numpy(tok.word_start_mask()))
    val_batches = [objective.batch({"input_ids": val[i * args.batch:(i + 1) * args.batch]})
                   for i in range(min(16, len(val) // args.batch))]
    keep = sorted({round(f * args.steps) for f in args.snapshots})
    epochs = math.ceil(args.steps * args.batch / len(train))
    rng = np.random.default_rng(cfg.seed)
    order = np.concatenate([rng.permutation(len(train)) for _ in range(epochs)])
    snapshots, curve, first, before = {}, [], 0, 0.0  # before: wall seconds of the earlier sittings
    if resume.exists():
        saved = torch.load(resume, weights_only=False)
        engine.module.load_state_dict(saved["model"])
        engine.optimizer.load_state_dict(saved["optimizer"])
        engine.scheduler.load_state_dict(saved["scheduler"])
        first, curve, before = saved["step"], saved["curve"], saved["wall_s"]
        snapshots = {s: load_file(partial / f"step-{s}.safetensors") for s in keep if s < first}
        print(f"pretraining: resuming {partial} at step {first}", file=sys.stderr, flush=True)
    started = time.perf_counter() - before

    def backbone() -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in engine.module.state_dict().items() if k.startswith("deberta.")}

    for step in range(first, args.steps + 1):
        if step in keep:
            snapshots[step] = backbone()
            save_file(snapshots[step], partial / f"step-{step}.safetensors")
            sums = validation_sums(engine, objective, masker, val_batches)
            curve.append({"step": step, "val_loss": round(objective.eval_metrics(sums)["val_loss"], 4),
                          "wall_s": round(time.perf_counter() - started, 1)})
            print(f"pretrain step {step}: {curve[-1]}", file=sys.stderr, flush=True)
        if step == args.steps:
            break
        rows = order[step * args.batch:(step + 1) * args.batch]
        out = train_step(engine, objective, masker, [objective.batch({"input_ids": train[rows]})], step)
        if (step + 1) % RESUME_EVERY == 0:
            print(f"pretrain step {step + 1}/{args.steps}: loss {out['loss']:.4f}, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            tmp = resume.with_suffix(".tmp")
            torch.save({"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                        "scheduler": engine.scheduler.state_dict(), "step": step + 1, "curve": curve,
                        "wall_s": time.perf_counter() - started}, tmp)
            tmp.replace(resume)  # whole or not at all
    wall = time.perf_counter() - started
    report = {"steps": args.steps, "batch": args.batch, "seq_len": train.shape[1], "lr": args.lr,
              "warmup": args.warmup, "train_sequences": len(train), "epochs": round(args.steps * args.batch /
                                                                                   len(train), 2),
              "wall_s": round(wall, 1), "tokens_per_s": round(args.steps * args.batch * train.shape[1] / wall),
              "curve": curve}
    final = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    save_file({k: v.numpy() for k, v in final.items()}, partial / "final.safetensors")
    (partial / "report.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(done, ignore_errors=True)
    partial.rename(done)
    (done / resume.name).unlink(missing_ok=True)  # only now: stopped before the rename, the run still resumes rather than restarts
    return report, snapshots, final


def export_released(state: dict, model, vocab_dir: Path, out: Path) -> Path:
    from deberta import hf
    from deberta.model import DebertaForMaskedLM

    mlm = DebertaForMaskedLM(model)
    mlm.load_state_dict(state)
    return hf.save_pretrained(mlm.eval(), out, vocab_dir=vocab_dir)


# ------------------------------------------------------------------------------------------------- fine-tuning

def review_corpus(task, path: Path) -> Path:
    """The task's training sentences, labels dropped, as a JSONL corpus (the dev sentences stay out)."""
    with open(path, "w") as f:
        for i, text in enumerate(task.train.text_a):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def finetune_all(args, model, vocab_dir: Path, backbones: dict[str, dict]) -> tuple[list[dict], Any]:
    import concurrent.futures as cf

    from bench.objectives import finetune_job
    from core.config import FinetuneConfig
    from stages.finetune.data import prepare_data
    from stages.finetune.tasks import resolve_task
    from stages.finetune.trial import TrialSetup

    task = resolve_task("rotten-tomatoes")
    ft = FinetuneConfig(task=task.name, dropout=(args.ft_dropout,), warmup_steps=(args.ft_warmup,), lr=(args.ft_lr,),
                        batch_size=(args.ft_batch,), seeds=args.seeds, epochs=args.ft_epochs,
                        max_seq_len=args.ft_seq_len, max_train_examples=args.ft_examples)
    data = prepare_data(task, vocab_dir, ft)
    setup = TrialSetup(model, task.num_labels, task.kind, task.metric, ft)
    config = {"dropout": args.ft_dropout, "warmup_steps": args.ft_warmup, "lr": args.ft_lr,
              "batch_size": args.ft_batch}
    trials = []
    with process_pool(args.procs, args.threads) as ex:
        futures = [ex.submit(finetune_job, {"objective": name, "setup": setup, "weights": weights, "data": data,
                                            "config": {**config, "seed": seed}})
                   for name, weights in backbones.items() for seed in args.seeds]
        for fut in cf.as_completed(futures):
            trials.append(fut.result())
            print(f"fine-tuned {trials[-1]['objective']} seed {trials[-1]['seed']}: {trials[-1]['dev']}",
                  file=sys.stderr, flush=True)
    return trials, (task, data, ft)


def tfidf(task, ft) -> dict[str, Any]:
    """TF-IDF + logistic regression, best of a small grid on the same train subset and dev split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    texts, labels = list(task.train.text_a), np.asarray(task.train.label)
    if ft.max_train_examples is not None and len(texts) > ft.max_train_examples:  # prepare_data's sample
        keep = np.sort(np.random.default_rng(0).permutation(len(texts))[:ft.max_train_examples])
        texts, labels = [texts[i] for i in keep], labels[keep]
    grid = []
    for ngrams in ((1, 1), (1, 2)):
        vec = TfidfVectorizer(ngram_range=ngrams, sublinear_tf=True, min_df=1)
        x, dev = vec.fit_transform(texts), vec.transform(list(task.dev.text_a))
        for c in (0.3, 1.0, 3.0, 10.0):
            clf = LogisticRegression(C=c, max_iter=2000).fit(x, labels)
            acc = float((clf.predict(dev) == np.asarray(task.dev.label)).mean())
            grid.append({"ngrams": list(ngrams), "C": c, "dev": round(acc, 4)})
    return {"best": max(grid, key=lambda g: g["dev"]), "grid": grid, "train_examples": len(texts)}


def summary(trials: list[dict], name: str) -> dict[str, Any]:
    scores = [t["dev"] for t in trials if t["objective"] == name]
    return {"dev_mean": round(float(np.mean(scores)), 4),
            "dev_std": round(float(np.std(scores, ddof=1)) if len(scores) > 1 else 0.0, 4), "scores": scores}


def against_random(rows: dict[str, dict]) -> None:
    """Each start's gap to random initialisation, and whether it exceeds the seed noise: the larger of the two
    starts' standard deviations across seeds (the spread a single run of either could land anywhere in)."""
    base = rows["random"]
    for name, r in rows.items():
        if name != "random":
            r["minus_random"] = round(r["dev_mean"] - base["dev_mean"], 4)
            r["beyond_seed_noise"] = bool(r["minus_random"] > max(r["dev_std"], base["dev_std"]))


def table(report: dict[str, Any]) -> str:
    rows = report["finetune"]["rows"]
    n = len(report["finetune"]["seeds"])
    lines = [f"| start | pretraining | dev accuracy (mean ± std, {n} seeds) | minus random | beyond the seed noise |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        gap = "" if name == "random" else f"{r['minus_random']:+.4f}"
        beyond = "" if name == "random" else ("yes" if r["beyond_seed_noise"] else "no")
        lines.append(f"| {name} | {r['what']} | {r['dev_mean']:.4f} ± {r['dev_std']:.4f} | {gap} | {beyond} |")
    t = report["tfidf"]["best"]
    lines.append(f"| TF-IDF + logistic regression | n-grams {tuple(t['ngrams'])}, C={t['C']:g} | {t['dev']:.4f} | | |")
    lines.append(f"| majority class | | {report['finetune']['majority_baseline']:.4f} | | |")
    a = report["adapt"]
    lines += ["", "| review-domain validation MLM loss | value |", "|---|---|",
              f"| released model, as transformers computes it | {a['val_loss_released']:.4f} |",
              f"| released model with the EMD as continuing starts it | {a['initial_val_loss']:.4f} |",
              f"| after {a['steps']} adaptation steps | {a['val_loss']:.4f} |"]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """News validation loss and rotten-tomatoes dev accuracy against news pretraining steps, beside the baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    news, rows = report["news_pretraining"], report["finetune"]["rows"]
    fig, (loss, acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    loss.plot([c["step"] for c in news["curve"]], [c["val_loss"] for c in news["curve"]], marker="o")
    loss.set(xlabel="pretraining steps on news", ylabel="validation MLM loss (news)", title="news pretraining")
    snaps = sorted((0 if name == "random" else int(name.split()[1]), r) for name, r in rows.items()
                   if name == "random" or name.startswith("news "))
    acc.errorbar([s for s, _ in snaps], [r["dev_mean"] for _, r in snaps], yerr=[r["dev_std"] for _, r in snaps],
                 marker="o", capsize=3, label="fine-tuned from the news model (step 0: random initialisation)")
    a = rows["adapted"]
    acc.errorbar([news["steps"]], [a["dev_mean"]], yerr=[a["dev_std"]], marker="s", capsize=3, color="tab:green",
                 linestyle="none", label=f"+ {report['adapt']['steps']} steps on the reviews (pipeline.run)")
    acc.axhline(report["tfidf"]["best"]["dev"], linestyle="--", color="tab:red", label="TF-IDF + logistic regression")
    acc.axhline(report["finetune"]["majority_baseline"], linestyle=":", color="tab:gray", label="majority class")
    acc.set(xlabel="pretraining steps on news", ylabel=f"dev accuracy (mean ± std, {len(report['finetune']['seeds'])}"
            " seeds)", title="rotten-tomatoes after fine-tuning")
    acc.legend(fontsize=7)
    for ax in (loss, acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(args.json.read_text())
        against_random(report["finetune"]["rows"])
        plot(report, args.json.with_suffix(".png"))
        print(table(report))
        return 0
    started = time.time()
    from stages.finetune.tasks import majority_baseline, resolve_task

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    arts = artifacts(pipeline(["--until", "tokenize", "--workdir", str(work / "news")]))
    tok_dir, vocab_dir = arts["tokenize"], arts["vocab"]
    model = _model(vocab_dir)
    news, snapshots, state = pretrain(args, tok_dir, vocab_dir, model)
    released = export_released(state, model, vocab_dir, work / "released")
    task = resolve_task("rotten-tomatoes")
    reviews = review_corpus(task, work / "reviews.jsonl")
    adapt_args = ["--corpus", str(reviews), "--workdir", str(work / "adapt"), "--until", "pretrain",
                  "--set", f"pretrain.init={released}", "--set", f"pretrain.max_steps={args.adapt_steps}",
                  "--set", f"pretrain.lr={args.adapt_lr}", "--set", f"pretrain.warmup_steps={args.adapt_steps // 10}",
                  "--set", f"pretrain.eval_interval={args.adapt_steps}", "--set",
                  f"pretrain.ckpt_interval={args.adapt_steps}", "--set", "pretrain.log_interval=50"]
    t0 = time.perf_counter()
    adapted = artifacts(pipeline(adapt_args))["pretrain"]
    adapt_wall = time.perf_counter() - t0
    metrics = json.loads((adapted / "metrics.json").read_text())
    from stages.finetune.data import backbone_weights  # the finetune stage's reader of a pretrain artifact

    backbones = {f"news step {s}": w for s, w in snapshots.items()}
    backbones["adapted"] = {k: v.numpy() for k, v in backbone_weights(adapted / "model").items()}
    trials, (task, data, ft) = finetune_all(args, model, vocab_dir, backbones)
    rows = {}
    for s in sorted(snapshots):
        what = "none (random initialisation)" if s == 0 else f"{s} steps on news"
        rows["random" if s == 0 else f"news {s}"] = {"what": what, **summary(trials, f"news step {s}")}
    rows["adapted"] = {"what": f"{args.steps} steps on news + {args.adapt_steps} on the reviews (pipeline.run "
                               f"pretrain.init)", **summary(trials, "adapted")}
    against_random(rows)
    report = {
        "command": " ".join(["python -m bench.continued", *(sys.argv[1:] if argv is None else argv)]),
        "model": {"preset": PRESET, "hidden_size": model.hidden_size, "layers": model.num_hidden_layers,
                  "vocab_rows": model.vocab_size},
        "news_pretraining": news,
        "adapt": {"steps": args.adapt_steps, "lr": args.adapt_lr, "corpus": "rotten-tomatoes train sentences "
                  f"({len(task.train.text_a)}), labels dropped", "wall_s": round(adapt_wall, 1),
                  **{k: metrics.get(k) for k in ("val_loss_released", "initial_val_loss", "val_loss")}},
        "finetune": {"task": task.name, "metric": task.metric, "train_examples": len(data[0]),
                     "dev_examples": len(data[1]), "epochs": args.ft_epochs, "lr": args.ft_lr,
                     "batch_size": args.ft_batch, "warmup_steps": args.ft_warmup, "dropout": args.ft_dropout,
                     "seeds": list(args.seeds), "majority_baseline": round(majority_baseline(task), 4),
                     "rows": rows, "trials": trials},
        "tfidf": tfidf(task, ft),
        "wall_s": round(time.time() - started, 1), "load_average": list(os.getloadavg()),
    }
    emit(report, args.json, table(report))
    if args.json:
        plot(report, args.json.with_suffix(".png"))
    return 0


def _model(vocab_dir: Path):
    """cpu-small's model with embedding rows for this vocabulary."""
    from core.tokenizer import Tokenizer
    from deberta.config import padded_vocab_size
    from pipeline.presets import MODEL_CPU_SMALL

    return MODEL_CPU_SMALL.replace(vocab_size=padded_vocab_size(len(Tokenizer.load(vocab_dir))))


if __name__ == "__main__":
    sys.exit(main())
