"""Batch prediction throughput on CPU, side by side in one run, on real text: Rotten Tomatoes reviews (sequence),
WNUT-2016 tweets (token), the SQuAD and Quoref records of allennlp's fixtures (span).

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.predict'      # ~10 min on 2 cores

Per kind and model size (the debug preset's model and cpu-small's, random weights over a real SentencePiece
vocabulary of the reviews: speed does not depend on what was learned), in one process on one thread (rows/s per
core), over the same rows after one warm-up batch:
  - `hf_pipeline`: transformers' own `pipeline(...)` on the HF export (text-classification, token-classification
    with aggregation "first"; transformers 5 has no question-answering pipeline any more, so the span kind has no
    peer but its ONNX twin), batch size `--batch`;
  - `predict_torch` / `predict_onnx`: `pipeline.predict`'s actor (`pipeline.predictor.Predictor`), the kind's own
    prediction path, on torch and on onnxruntime over the checked ONNX export.
Then `python -m pipeline.predict` end to end on the debug sequence model with 1 and 2 actors of one CPU each (the
run's own seconds: Ray's start is not counted, the actors' start is). The physical limit: the forward FLOPs of a
row (`deberta.flops`, matmuls, at each row's own token count) against the one-thread matmul rate measured here at
the model's shapes. Writes bench/results/predict.json (or `--json PATH`) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from bench.common import RESULTS, command_line, comma_ints, emit, load_average

FIXTURES = "allennlp/tests/fixtures/data"
MAX_LEN, STRIDE = 64, 16  # the debug preset's finetune.max_seq_len and doc_stride


def texts_of(kind: str, rows: int) -> dict[str, list[str]]:
    """`rows` real inputs of a kind as its model's columns (the data repeated when it has fewer)."""
    from core.datasets import site_packages_file
    from stages.finetune.tasks import resolve_task

    if kind == "sequence":
        task = resolve_task("rotten-tomatoes")
        base = {"sentence1": list(task.train.text_a) + list(task.dev.text_a)}
    elif kind == "token":
        task = resolve_task("wnut16-ner")
        base = {"text": [" ".join(w) for w in list(task.train.words) + list(task.dev.words)]}
    else:
        qs, cs = [], []
        for name in ("squad.json", "quoref/quoref_sample.json"):
            for article in json.loads(site_packages_file(f"{FIXTURES}/{name}").read_text())["data"]:
                for para in article["paragraphs"]:
                    qs += [qa["question"] for qa in para["qas"]]
                    cs += [para["context"]] * len(para["qas"])
        base = {"question": qs, "context": cs}
    n = len(next(iter(base.values())))
    return {k: [v[i % n] for i in range(rows)] for k, v in base.items()}


def build_models(root: Path, sizes: list[str]) -> dict[tuple[str, str], Path]:
    """(kind, size) -> an HF export of a random head over a vocabulary trained on the reviews."""
    import torch

    from core.config import VocabConfig
    from core.tokenizer import MODEL_FILE, SPECIAL_FILE, Tokenizer
    from deberta import hf
    from deberta.config import debug
    from deberta.heads import DebertaForQuestionAnswering, DebertaForSequenceClassification, DebertaForTokenClassification
    from pipeline.presets import MODEL_CPU_SMALL
    from stages.vocab import train_model

    vocab = root / "vocab"
    vocab.mkdir(parents=True)
    (root / "sample.txt").write_text("\n".join(texts_of("sequence", 20_000)["sentence1"]) + "\n")
    train_model(VocabConfig(vocab_size=2_000), root / "sample.txt", vocab, num_threads=1)
    (vocab / SPECIAL_FILE).write_text(json.dumps(Tokenizer.load(vocab / MODEL_FILE).special_ids))
    configs = {"debug": debug(vocab_size=2_100), "cpu-small": MODEL_CPU_SMALL.replace(vocab_size=2_100)}
    out = {}
    torch.manual_seed(0)
    for size in sizes:
        cfg = configs[size]
        heads = {"sequence": (DebertaForSequenceClassification(cfg, num_labels=2, classifier_dropout=0.1),
                              ("rotten", "fresh"), {}),
                 "token": (DebertaForTokenClassification(cfg, num_labels=5, classifier_dropout=0.1),
                           ("O", "B-cap", "I-cap", "B-handle", "I-handle"), {"doc_stride": STRIDE}),
                 "span": (DebertaForQuestionAnswering(cfg, classifier_dropout=0.1), None,
                          {"doc_stride": STRIDE, "max_answer_len": 30, "squad_version": "v1.1",
                           "null_score_threshold": None})}
        for kind, (model, labels, extra) in heads.items():
            out[kind, size] = hf.save_pretrained(model.eval(), root / f"{kind}-{size}", vocab_dir=vocab, labels=labels,
                                                 model_max_length=MAX_LEN, config_extra=extra)
    return out


def hf_rate(kind: str, hf_dir: Path, columns: dict[str, list[str]], batch: int) -> float | None:
    """transformers' pipeline, rows/s on this thread (None where transformers has none)."""
    import transformers

    if kind == "sequence":
        pipe = transformers.pipeline("text-classification", model=str(hf_dir), device="cpu")
        call = lambda n: pipe(columns["sentence1"][:n], batch_size=batch, truncation=True)  # noqa: E731
    elif kind == "token":
        pipe = transformers.pipeline("token-classification", model=str(hf_dir), device="cpu",
                                     aggregation_strategy="first", stride=STRIDE)
        call = lambda n: pipe(columns["text"][:n], batch_size=batch)  # noqa: E731
    else:  # transformers 5 removed its question-answering pipeline: no peer of its own for the span kind
        return None
    return _rate(call, len(next(iter(columns.values()))), batch)


def predictor_rate(kind: str, hf_dir: Path, columns: dict[str, list[str]], batch: int, backend: str,
                   cache: Path) -> tuple[float, float, float]:
    """pipeline.predict's actor over the rows, in batches of `batch`: (rows/s on this thread, mean tokens of a window,
    windows per row: a long text or context is read in overlapping windows)."""
    import pyarrow as pa

    from pipeline.predict import resolve_model
    from pipeline.predictor import REASON, Predictor

    ref, inputs, _, _ = resolve_model(str(hf_dir), str(cache))
    ref = ref.__class__(**{**ref.__dict__, "columns": tuple((c, c) for c in inputs), "backend": backend, "threads": 1})
    actor = Predictor(ref)
    n = len(next(iter(columns.values())))
    table = pa.table({"row_id": [str(i) for i in range(n)], "source": ["bench"] * n, "index": list(range(n)),
                      **columns, REASON: pa.nulls(n, pa.string())})
    rate = _rate(lambda m: [actor(table.slice(s, min(batch, m - s))) for s in range(0, m, batch)], n, batch)
    ids = actor.kind.encode_inputs(actor.tokenizer, {c: columns[c][:512] for c in inputs}, actor.settings).ids
    return rate, float((ids != 0).sum(1).mean()), len(ids) / min(512, n)  # tokens per window, windows per row


def _rate(call, n: int, batch: int) -> float:
    call(batch)  # warm-up: first-call allocations and lazy inits
    start = time.perf_counter()
    call(n)
    return n / (time.perf_counter() - start)


def matmul_rate(m: int, k: int, n: int, repeats: int = 200) -> float:
    """One-thread FLOP/s of (m, k) @ (k, n) float32, best of three."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n * repeats / best


ROLES = (("actors", ("MapWorker",)), ("reader", ("read_rows", "ReadRows", "FromItems")), ("writer", ("Write",)),
         ("ray", ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "ray::IDLE",
                  "default_worker", "ray::")))
"""A process's role in a `pipeline.predict` run, by its command line (Ray sets a worker's to what it runs: the
actor `ray::MapWorker(MapBatches(Predictor))`, a task `ray::MapBatches(read_rows)` or `ray::Write`); the rest is
the driver (the command itself: Ray Data's streaming executor)."""


class CpuAccount:
    """CPU seconds of a command's process tree by role (`ROLES`), and of the whole machine, sampled every
    `period` seconds: each process's CPU time since the last sample is given to the role its command line names
    at this sample (a pooled Ray worker that reads, then writes, is counted where it was seen). A process's last
    `period` before it exits is not seen. `others`: the machine's busy CPU seconds that were not this tree's."""

    def __init__(self, pid: int, period: float = 0.5):
        import psutil

        self.root, self.period, self.psutil = pid, period, psutil
        self.last: dict[int, float] = {}
        self.by_role = {r: 0.0 for r, _ in ROLES} | {"driver": 0.0}
        self.machine0 = self._busy()

    def _busy(self) -> float:
        t = self.psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def _role(self, cmdline: str) -> str:
        return next((r for r, words in ROLES if any(w in cmdline for w in words)), "driver")

    def sample(self) -> None:
        ps = self.psutil
        try:
            procs = [ps.Process(self.root), *ps.Process(self.root).children(recursive=True)]
        except ps.Error:
            return
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu, role = t.user + t.system, ("driver" if p.pid == self.root else
                                                    self._role(" ".join(p.cmdline())))
            except ps.Error:
                continue
            self.by_role[role] += cpu - self.last.get(p.pid, 0.0)
            self.last[p.pid] = cpu

    def report(self, wall: float) -> dict:
        ours = sum(self.by_role.values())
        return {"cpu_s": {k: round(v, 1) for k, v in self.by_role.items()}, "cpu_s_ours": round(ours, 1),
                "cpu_s_others": round(self._busy() - self.machine0 - ours, 1), "wall_s": round(wall, 1),
                "cores_busy_ours": round(ours / wall, 2)}


def run_accounted(cmd: list[str], env: dict[str, str]) -> tuple[str, dict]:
    """The command's output and its `CpuAccount` report; SystemExit when it fails."""
    log = Path(tempfile.mkstemp(prefix="predict-", suffix=".log")[1])
    started = time.time()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
    account = CpuAccount(proc.pid)
    while proc.poll() is None:
        account.sample()
        time.sleep(account.period)
    text = log.read_text()
    log.unlink()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    return text, account.report(time.time() - started)


def end_to_end(hf_dir: Path, rows: int, root: Path, actors: int, batch: int = 256) -> dict:
    """`python -m pipeline.predict` with `actors` actors of one CPU: the rows/s it reports, and where the CPU went
    (`CpuAccount`: the actors' share against Ray Data's reader and writer, the driver, Ray, and everything else
    on the machine)."""
    corpus = root / "e2e.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts_of("sequence", rows)["sentence1"]))
    out = root / f"out-{actors}-{batch}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipeline.predict", str(hf_dir), "--input", str(corpus), "--output", str(out),
           "--column", "sentence1=text", "--actors", str(actors), "--cpus-per-actor", "1", "--batch-size",
           str(batch), "--cache", str(root / "cache")]
    text, cpu = run_accounted(cmd, {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})
    m = re.search(r"(\d+) rows \((\d+) answered\).* in ([\d.]+) s", text)
    n, seconds = int(m.group(1)), float(m.group(3))
    return {"actors": actors, "batch": batch, "rows": n, "seconds": seconds, "rows_per_s": round(n / seconds, 1),
            "actor_cpu_ms_per_row": round(1e3 * cpu["cpu_s"]["actors"] / n, 3), **cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000, help="rows per kind in one process (span: a fifth; cpu-small: "
                                                            "a quarter)")
    ap.add_argument("--e2e-rows", type=int, default=20_000, help="rows of the end-to-end runs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sizes", default="debug,cpu-small")
    ap.add_argument("--json", type=Path, default=None, help="default bench/results/predict.json (predict_scaling.json "
                                                            "with --scaling)")
    ap.add_argument("--scaling", action="store_true", help="only the end-to-end runs: 1 and 2 actors interleaved, "
                                                          "--repeats times per --e2e-batches size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ceiling", action="store_true", help="only 1 and 2 one-thread processes without Ray (the actor's "
                    "work and plain matmuls): the most 2 actors can get over 1 on this machine "
                    "(bench/results/predict_ceiling.json)")
    ap.add_argument("--ceiling-rows", type=int, default=4_000, help="reviews per process of --ceiling")
    ap.add_argument("--e2e-batches", type=comma_ints, default=(256,), help="actor batch sizes of --scaling")
    args = ap.parse_args()
    if args.scaling:
        return scaling(args)
    if args.ceiling:
        return ceiling(args)
    args.json = args.json or RESULTS / "predict.json"
    import torch

    from deberta import hf
    from deberta.flops import forward_flops_per_token

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-predict-"))
    sizes = args.sizes.split(",")
    models = build_models(root, sizes)
    kinds, lines = {}, ["| kind | size | rows | transformers pipeline | torch / pipeline | onnx / pipeline | "
                        "predict torch | predict onnx | onnx / torch | limit rows/s | torch / limit |",
                        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, size), hf_dir in models.items():
        rows = args.rows // (5 if kind == "span" else 1) // (4 if size == "cpu-small" else 1)
        columns = texts_of(kind, rows)
        hf_cfg = json.loads((hf_dir / "config.json").read_text())
        h, i, layers = hf_cfg["hidden_size"], hf_cfg["intermediate_size"], hf_cfg["num_hidden_layers"]
        hf_r = hf_rate(kind, hf_dir, columns, args.batch)
        torch_r, tokens, windows = predictor_rate(kind, hf_dir, columns, args.batch, "torch", root / "cache")
        onnx_r, _, _ = predictor_rate(kind, hf_dir, columns, args.batch, "onnx", root / "cache")
        flops_row = forward_flops_per_token(hf.from_hf_config(_hf_config(hf_dir)), int(round(tokens)),
                                            task="backbone") * tokens * windows
        rate = matmul_rate(args.batch * MAX_LEN, h, i)
        row = {"rows": len(next(iter(columns.values()))), "tokens_per_window": round(tokens, 1),
               "windows_per_row": round(windows, 2),
               "hf_pipeline_rows_per_s": hf_r and round(hf_r, 1), "predict_torch_rows_per_s": round(torch_r, 1),
               "predict_onnx_rows_per_s": round(onnx_r, 1), "torch_vs_pipeline": hf_r and round(torch_r / hf_r, 2),
               "onnx_vs_pipeline": hf_r and round(onnx_r / hf_r, 2), "onnx_vs_torch": round(onnx_r / torch_r, 2),
               "forward_mflops_per_row": round(flops_row / 1e6, 2),
               "matmul_gflops_1thread": round(rate / 1e9, 2), "limit_rows_per_s": round(rate / flops_row, 1),
               "torch_of_limit": round(torch_r * flops_row / rate, 3), "layers": layers, "hidden": h}
        kinds[f"{kind}/{size}"] = row
        peer = (f"{hf_r:.0f} | {row['torch_vs_pipeline']:.2f}x | {row['onnx_vs_pipeline']:.2f}x" if hf_r
                else "none | - | -")
        lines.append(f"| {kind} | {size} | {row['rows']} | {peer} | {torch_r:.0f} | {onnx_r:.0f} | "
                     f"{row['onnx_vs_torch']:.2f}x | {row['limit_rows_per_s']:.0f} | {row['torch_of_limit']:.1%} |")
        print(lines[-1], flush=True)
    e2e = {f"actors_{n}": end_to_end(models["sequence", sizes[0]], args.e2e_rows, root, n) for n in (1, 2)}
    e2e["scaling_2_over_1"] = round(e2e["actors_2"]["rows_per_s"] / e2e["actors_1"]["rows_per_s"], 2)
    report = {"bench": "predict", "command": command_line(), "batch": args.batch, "max_seq_len": MAX_LEN,
              "load_average": load_average(), "cpus": os.cpu_count(), "kinds": kinds,
              "end_to_end": {"kind": "sequence", "size": sizes[0], **e2e}}
    lines += ["", "| pipeline.predict end to end | rows | seconds | rows/s |", "|---|---|---|---|"]
    lines += [f"| {n} | {e2e[n]['rows']} | {e2e[n]['seconds']:.1f} | {e2e[n]['rows_per_s']:.0f} |"
              for n in ("actors_1", "actors_2")]
    emit(report, args.json, "\n".join(lines))


def scaling(args) -> None:
    """1 and 2 actors, interleaved (1, 2, 1, 2, ...: a load that comes and goes falls on both), per batch size;
    each run's rows/s and where its CPU went (`CpuAccount`)."""
    import statistics

    root = Path(tempfile.mkdtemp(prefix="bench-predict-scaling-"))
    hf_dir = build_models(root, ["debug"])["sequence", "debug"]
    runs, lines = [], ["| batch | actors | rows/s | actor CPU ms/row | CPU s: actors | reader | writer | driver | "
                       "Ray | others on the machine | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rep in range(args.repeats):
        for batch in args.e2e_batches:
            for actors in (1, 2):
                run = end_to_end(hf_dir, args.e2e_rows, root, actors, batch)
                runs.append(run)
                c = run["cpu_s"]
                lines.append(f"| {batch} | {actors} | {run['rows_per_s']:.0f} | {run['actor_cpu_ms_per_row']:.3f} | "
                             f"{c['actors']:.1f} | {c['reader']:.1f} | {c['writer']:.1f} | {c['driver']:.1f} | "
                             f"{c['ray']:.1f} | {run['cpu_s_others']:.1f} | {run['wall_s']:.1f} |")
                print(lines[-1], flush=True)
    summary = {}
    for batch in args.e2e_batches:
        rate = {n: [r["rows_per_s"] for r in runs if r["batch"] == batch and r["actors"] == n] for n in (1, 2)}
        pairs = [b / a for a, b in zip(rate[1], rate[2])]
        summary[f"batch_{batch}"] = {"median_rows_per_s_1": statistics.median(rate[1]),
                                     "median_rows_per_s_2": statistics.median(rate[2]),
                                     "scaling_2_over_1_median": round(statistics.median(rate[2]) /
                                                                      statistics.median(rate[1]), 2),
                                     "scaling_2_over_1_pairs": [round(p, 2) for p in pairs]}
    report = {"bench": "predict_scaling", "command": command_line(), "rows": args.e2e_rows, "kind": "sequence",
              "size": "debug", "load_average": load_average(), "cpus": os.cpu_count(), "summary": summary,
              "runs": runs}
    emit(report, args.json or RESULTS / "predict_scaling.json", "\n".join(lines))


def _ceiling_job(hf_dir: str, rows: int, batch: int, start_at: float, work: str) -> dict:
    """One process of `ceiling` (one torch thread): the actor's own work on `rows` reviews (`work` "predict"), or a
    fixed run of `rows` one-thread matmuls at the debug model's FFN shape ("matmul"), timed from the wall-clock instant
    `start_at` (after the model is loaded and one batch warmed up, so side-by-side processes overlap)."""
    import torch

    if work == "predict":
        import pyarrow as pa

        from pipeline.predict import resolve_model
        from pipeline.predictor import REASON, Predictor

        ref, inputs, _, _ = resolve_model(hf_dir, str(Path(hf_dir).parent / f"cache-{os.getpid()}"))
        ref = ref.__class__(**{**ref.__dict__, "columns": tuple((c, c) for c in inputs), "threads": 1})
        actor, columns = Predictor(ref), texts_of("sequence", rows)
        table = pa.table({"row_id": [str(i) for i in range(rows)], "source": ["bench"] * rows,
                          "index": list(range(rows)), **columns, REASON: pa.nulls(rows, pa.string())})
        actor(table.slice(0, batch))  # warm-up

        def run() -> None:
            for s in range(0, rows, batch):
                actor(table.slice(s, min(batch, rows - s)))
    else:
        torch.set_num_threads(1)
        a, b = torch.randn(64 * MAX_LEN, 64), torch.randn(64, 256)  # 64 rows of the FFN's first matmul

        def run() -> None:
            for _ in range(rows):
                a @ b
    time.sleep(max(0.0, start_at - time.time()))
    start, cpu = time.time(), time.process_time()
    run()
    end = time.time()
    return {"start": start, "end": end, "wall_s": end - start, "cpu_s": time.process_time() - cpu}


def ceiling(args) -> None:
    """What two one-thread processes get on this machine against one, without Ray: the actor's own work (the debug
    sequence model over the same reviews, `Predictor` as pipeline.predict's actors run it) and plain matmuls, alone
    and two side by side, interleaved `--repeats` times. 2 x rows / (the pair's span) over one process's rows/s is
    the most 2 actors can get over 1 here, whatever Ray does."""
    import statistics

    from bench.common import process_pool

    root = Path(tempfile.mkdtemp(prefix="bench-predict-ceiling-"))
    hf_dir = str(build_models(root, ["debug"])["sequence", "debug"])
    work_rows = {"predict": args.ceiling_rows, "matmul": args.ceiling_rows}
    runs, lines = [], ["| work | processes | rows/s (all processes) | wall s | CPU s per process |", "|---|---|---|---|---|"]
    for rep in range(args.repeats):
        for work, rows in work_rows.items():
            for procs in (1, 2):
                with process_pool(procs, 1) as pool:
                    start_at = time.time() + 12  # after every process has loaded its model (~3 s)
                    jobs = [pool.submit(_ceiling_job, hf_dir, rows, args.batch, start_at, work) for _ in range(procs)]
                    done = [j.result() for j in jobs]
                span = max(d["end"] for d in done) - min(d["start"] for d in done)
                overlap = min(d["end"] for d in done) - max(d["start"] for d in done)
                run = {"work": work, "processes": procs, "rows": rows * procs, "span_s": round(span, 2),
                       "overlap_of_span": round(overlap / span, 3), "rows_per_s": round(rows * procs / span, 1),
                       "cpu_s": [round(d["cpu_s"], 2) for d in done], "repeat": rep}
                runs.append(run)
                lines.append(f"| {work} | {procs} | {run['rows_per_s']:.1f} | {span:.1f} | "
                             f"{', '.join(f'{c:.1f}' for c in run['cpu_s'])} |")
                print(lines[-1], flush=True)
    summary = {}
    for work in work_rows:
        rate = {n: [r["rows_per_s"] for r in runs if r["work"] == work and r["processes"] == n] for n in (1, 2)}
        summary[work] = {"median_rows_per_s_1": statistics.median(rate[1]),
                         "median_rows_per_s_2": statistics.median(rate[2]),
                         "two_over_one": round(statistics.median(rate[2]) / statistics.median(rate[1]), 2),
                         "two_over_one_pairs": [round(b / a, 2) for a, b in zip(rate[1], rate[2])]}
    report = {"bench": "predict_ceiling", "command": command_line(), "kind": "sequence", "size": "debug",
              "batch": args.batch, "load_average": load_average(), "cpus": os.cpu_count(), "summary": summary,
              "runs": runs}
    emit(report, args.json or RESULTS / "predict_ceiling.json", "\n".join(lines))


def _hf_config(hf_dir: Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(str(hf_dir))


if __name__ == "__main__":
    main()
