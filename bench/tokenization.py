"""Benchmark: tokens/s of the tokenize stage with 1 and 2 workers beside a plain single-process encode loop.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.tokenization'

The corpus is the built-in news articles (repeated `--copies` times, as Parquet shards of `--rows-per-shard`
documents); the vocabulary is trained once by the vocab stage. "tokens" are SentencePiece ids of the documents
(framing and padding excluded), the same number for the baseline and the stage. CPU efficiency = the baseline's
CPU seconds / the CPU seconds the actors spent on their work units (reading, encoding, packing, writing): a
measure of per-worker overhead that, unlike wall time, holds on a machine shared with other jobs. "2 processes,
arrays" runs two plain loops at once on halves of the text: the scaling this machine itself allows. The reference
single-process rate is the faster of two plain loops (`encode_as_numpy`, which the stage's actors use; `encode` to
lists is shown too). The stage's time is its whole `run()`: actor start-up, Parquet reading, packing and writing
included. Goals: 2 workers >= 0.8 x linear scaling of 1 worker, and each worker >= 0.9 x the single-process rate.
Prints one JSON object (also written to --json), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import REPO, RESULTS, comma_ints, command_line, emit
from core.artifacts import Artifact
from core.config import TokenizeConfig, VocabConfig
from core.datasets import materialize_corpus
from core.tokenizer import Tokenizer
from stages import tokenize as tokenize_stage
from stages import vocab as vocab_stage
from stages.base import StageContext


def write_corpus(root: Path, docs: list[tuple[str, str]], rows_per_shard: int) -> tuple[Artifact, list[str]]:
    """A corpus artifact directory (5% validation, Parquet shards of rows_per_shard documents) and its texts."""
    n_val = max(1, len(docs) // 20)
    split = {"validation": docs[:n_val], "train": docs[n_val:]}
    for name, rows in split.items():
        (root / name).mkdir(parents=True)
        for s in range(0, len(rows), rows_per_shard):
            part = rows[s:s + rows_per_shard]
            pq.write_table(pa.table({"doc_id": [d for d, _ in part], "text": [t for _, t in part],
                                     "source": ["news"] * len(part)}), root / name / f"{s:08d}.parquet")
    return Artifact("corpus", root.name, root), [t for _, t in split["train"]] + [t for _, t in split["validation"]]


def ctx_for(root: Path, name: str) -> StageContext:
    return StageContext(artifact_id=name, workdir=root, scratch=root / "scratch" / name, storage_path=str(root),
                        tracker=None)


def baseline(tok: Tokenizer, texts: list[str], batch_size: int, arrays: bool) -> tuple[int, float, float]:
    """Plain single-process loop: sentencepiece encode (as lists or numpy arrays), one thread, the stage's batches.

    Returns (tokens, wall seconds, CPU seconds)."""
    encode = tok.encode_arrays if arrays else tok.encode
    start, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for i in range(0, len(texts), batch_size):
        tokens += sum(len(ids) for ids in encode(texts[i:i + batch_size], num_threads=1))
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def _encode_count(args: tuple[Tokenizer, list[str], int]) -> int:
    tok, texts, batch_size = args
    return baseline(tok, texts, batch_size, arrays=True)[0]


def parallel_baseline(tok: Tokenizer, texts: list[str], batch_size: int, processes: int) -> float:
    """Wall seconds of `processes` plain loops on equal slices at once: this machine's own scaling ceiling."""
    import multiprocessing

    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        pool.map(_encode_count, [(tok, texts[:1], 1)] * processes)  # start the processes before timing
        start = time.perf_counter()
        pool.map(_encode_count, [(tok, texts[i::processes], batch_size) for i in range(processes)])
        return time.perf_counter() - start
    finally:
        pool.close()  # not terminate(): the children inherit Ray's SIGTERM handler, which prints a stack
        pool.join()


def time_stage(root: Path, corpus: Artifact, vocab: Artifact, cfg: TokenizeConfig, rep: int) -> tuple[float, float]:
    """(wall seconds of the whole run, CPU seconds the actors spent on their work units)."""
    name = f"tokens-{corpus.id}-{cfg.num_workers}-{rep}"
    start = time.perf_counter()
    result = tokenize_stage.run(cfg, inputs={"corpus": corpus, "vocab": vocab}, out=_mkdir(root / name),
                                ctx=ctx_for(root, name))
    seconds = time.perf_counter() - start
    shutil.rmtree(root / name)
    written = result.counts["train_tokens"] + result.counts["validation_tokens"]  # framing included
    return seconds, written / result.metrics["tokens_per_actor_cpu_second"]


def profile(tok: Tokenizer, corpus: Artifact, cfg: TokenizeConfig, root: Path) -> dict[str, float]:
    """CPU seconds of each phase of the stage's per-token work on the train split, run in this process on one
    thread (the pack tasks' code, `PackDocuments`: its reads, encode, packing and shard writing), without Ray:
    where the time goes."""
    out = _mkdir(root / "profile")
    _mkdir(out / "train")
    packer = tokenize_stage.PackDocuments(tok, cfg.max_seq_len, cfg.batch_size, cfg.rows_per_shard, str(out))
    phases = dict.fromkeys(("read text", "encode", "pack + table", "write (Arrow IPC)"), 0.0)
    clock = time.process_time

    def timed(path: str, row_group: int):  # `packed_batches`, each phase on its own clock
        t = clock()
        for doc_ids, texts in packer.reads(path, row_group):
            phases["read text"] += clock() - t
            t = clock()
            ids = tok.encode_arrays(texts, num_threads=1)
            phases["encode"] += clock() - t
            t = clock()
            table = packer.packed(doc_ids, ids)
            phases["pack + table"] += clock() - t
            yield table
            t = clock()
        phases["read text"] += clock() - t

    for unit in tokenize_stage.row_groups({"train": sorted((corpus.path / "train").glob("*.parquet"))}):
        before, t = sum(phases.values()), clock()
        for _ in packer.write_unit("train", unit["unit"], timed(unit["path"], unit["row_group"])):
            pass
        phases["write (Arrow IPC)"] += clock() - t - (sum(phases.values()) - before)  # the rest of the unit's time
    shutil.rmtree(out)
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tokenization", description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8, help="times the 3,824 news articles are repeated (8: 102 MB)")
    ap.add_argument("--rows-per-shard", type=int, default=500, help="documents per corpus Parquet shard")
    ap.add_argument("--vocab-size", type=int, default=8_000)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=comma_ints, default=(1, 2), help="comma-separated tokenize.num_workers to time")
    ap.add_argument("--repeats", type=int, default=2, help="each measurement's best of this many runs")
    ap.add_argument("--json", type=Path, default=RESULTS / "tokenization.json", help="the JSON report's file")
    args = ap.parse_args()
    workers = list(args.workers)

    import ray

    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    news = [json.loads(line)["text"] for line in open(materialize_corpus("news", root / "raw"))]
    docs = [(f"news-{c}-{i}", t) for c in range(args.copies) for i, t in enumerate(news)]
    corpus, texts = write_corpus(root / "corpus", docs, args.rows_per_shard)
    # A one-shard corpus times the stage's fixed cost (actor start-up, planning), so the marginal rate can be shown.
    small, small_texts = write_corpus(root / "small", docs[:args.rows_per_shard], args.rows_per_shard)
    vocab_stage.run(VocabConfig(vocab_size=args.vocab_size, sample_documents=2_000), inputs={"corpus": corpus},
                    out=_mkdir(root / "vocab"), ctx=ctx_for(root, "vocab"))
    vocab = Artifact("vocab", "bench", root / "vocab")
    tok = Tokenizer.load(vocab.path)
    small_tokens = baseline(tok, small_texts, args.batch_size, arrays=True)[0]

    ray.init(num_cpus=max(workers), object_store_memory=1 << 30, include_dashboard=False,
             configure_logging=False, log_to_driver=False)
    # Best of --repeats, measurements interleaved: on a shared machine the minimum is the least disturbed run.
    list_s = list_cpu = base_s = base_cpu = two_s = float("inf")
    times = {w: {"fixed": float("inf"), "seconds": float("inf"), "cpu": float("inf")} for w in workers}
    for rep in range(args.repeats):
        tokens, seconds, cpu = baseline(tok, texts, args.batch_size, arrays=False)
        list_s, list_cpu = min(list_s, seconds), min(list_cpu, cpu)
        tokens, seconds, cpu = baseline(tok, texts, args.batch_size, arrays=True)  # the faster loop: the reference
        base_s, base_cpu = min(base_s, seconds), min(base_cpu, cpu)
        if 2 in workers:
            two_s = min(two_s, parallel_baseline(tok, texts, args.batch_size, 2))
        for w in workers:
            cfg = TokenizeConfig(max_seq_len=args.max_seq_len, batch_size=args.batch_size, num_workers=w)
            times[w]["fixed"] = min(times[w]["fixed"], time_stage(root, small, vocab, cfg, rep)[0])
            seconds, cpu = time_stage(root, corpus, vocab, cfg, rep)
            times[w]["seconds"], times[w]["cpu"] = min(times[w]["seconds"], seconds), min(times[w]["cpu"], cpu)
    ray.shutdown()
    phases = profile(tok, corpus, TokenizeConfig(max_seq_len=args.max_seq_len, batch_size=args.batch_size), root)
    shutil.rmtree(root, ignore_errors=True)

    base_rate = tokens / base_s
    stage = {}
    for w, t in times.items():
        marginal = (tokens - small_tokens) / max(t["seconds"] - t["fixed"], 1e-9)
        stage[w] = {"seconds": t["seconds"], "tokens_per_s": tokens / t["seconds"],
                    "per_worker_vs_single": tokens / t["seconds"] / w / base_rate, "one_shard_seconds": t["fixed"],
                    "marginal_tokens_per_s": marginal, "marginal_per_worker_vs_single": marginal / w / base_rate,
                    "actor_cpu_seconds": t["cpu"], "cpu_efficiency_vs_single": base_cpu / t["cpu"],
                    "cpu_efficiency_vs_single_lists": list_cpu / t["cpu"]}

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    report = {
        "command": command_line(), "commit": head.stdout.strip() or None,
        "documents": len(texts), "text_mb": sum(len(t.encode()) for t in texts) / 1e6, "tokens": tokens,
        "vocab_size": args.vocab_size, "max_seq_len": args.max_seq_len, "cpus": os.cpu_count(),
        "load_average_1m_at_end": os.getloadavg()[0], "repeats": args.repeats,
        "single_process": {"seconds": base_s, "tokens_per_s": base_rate, "api": "encode_as_numpy",
                           "cpu_seconds": base_cpu, "tokens_per_cpu_s": tokens / base_cpu},
        "single_process_lists": {"seconds": list_s, "tokens_per_s": tokens / list_s, "api": "encode",
                                 "cpu_seconds": list_cpu},
        "stage": stage,
        "profile_cpu_seconds": phases,
    }
    if 2 in workers:
        report["two_processes_plain"] = {"seconds": two_s, "tokens_per_s": tokens / two_s,
                                         "scaling_vs_one": base_s / two_s / 2}
    if 1 in stage and 2 in stage:
        report["scaling_2_vs_1"] = stage[2]["tokens_per_s"] / (2 * stage[1]["tokens_per_s"])
        report["marginal_scaling_2_vs_1"] = stage[2]["marginal_tokens_per_s"] / (2 * stage[1]["marginal_tokens_per_s"])
    emit(report, args.json, table(report))


def table(report: dict) -> str:
    tokens, single, lists = report["tokens"], report["single_process"], report["single_process_lists"]
    base_s, base_cpu = single["seconds"], single["cpu_seconds"]
    list_s, list_cpu = lists["seconds"], lists["cpu_seconds"]
    head = ("run", "seconds", "tokens/s", "/worker/single", "marginal /worker", "CPU eff. (arrays)", "(lists)")
    lines = ["{:<22}{:>8}{:>12}{:>16}{:>18}{:>19}{:>9}".format(*head),
             f"{'1 process, lists':<22}{list_s:>8.1f}{tokens / list_s:>12,.0f}{base_s / list_s:>16.2f}"
             f"{'':>18}{base_cpu / list_cpu:>19.2f}{1.0:>9.2f}",
             f"{'1 process, arrays':<22}{base_s:>8.1f}{tokens / base_s:>12,.0f}{1.0:>16.2f}{'':>18}{1.0:>19.2f}"
             f"{list_cpu / base_cpu:>9.2f}"]
    if "two_processes_plain" in report:
        two_s = report["two_processes_plain"]["seconds"]
        lines.append(f"{'2 processes, arrays':<22}{two_s:>8.1f}{tokens / two_s:>12,.0f}{base_s / two_s / 2:>16.2f}")
    for w, s in report["stage"].items():
        lines.append(f"{f'stage, {w} worker(s)':<22}{s['seconds']:>8.1f}{s['tokens_per_s']:>12,.0f}"
                     f"{s['per_worker_vs_single']:>16.2f}{s['marginal_per_worker_vs_single']:>18.2f}"
                     f"{s['cpu_efficiency_vs_single']:>19.2f}{s['cpu_efficiency_vs_single_lists']:>9.2f}")
    phases = report["profile_cpu_seconds"]
    lines += ["", "where one worker's CPU goes (in-process, 1 thread; Ray start-up excluded):"]
    lines += [f"  {phase:<24}{seconds:>7.2f} s  {seconds / phases['encode']:>5.2f} x encode"
              for phase, seconds in phases.items()]
    if "scaling_2_vs_1" in report:
        lines.append(f"scaling 2 vs 1 worker: {report['scaling_2_vs_1']:.2f} x linear end to end, "
                     f"{report['marginal_scaling_2_vs_1']:.2f} x marginal (goal >= 0.8); two plain processes here: "
                     f"{report['two_processes_plain']['scaling_vs_one']:.2f} x linear")
    return "\n".join(lines)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


if __name__ == "__main__":
    main()
