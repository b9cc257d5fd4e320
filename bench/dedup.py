"""Dedup benchmark: the corpus stage vs datasketch.MinHashLSH on real news text.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.dedup --editions 1000 --cpus 2'
    ... --editions 20000 --no-truth      # 23,824 documents: throughputs only (the truth is quadratic)
    ... --editions 40000 --stage-only    # 43,824 documents: the stage alone

Corpus: the 3,824 built-in news articles (which carry natural duplicates: the same story under
two headlines, re-published transcripts) plus `--editions` edited versions of random articles
at Jaccard levels spread over [0.4, 1) (words replaced, as a later edition would). Ground truth:
brute-force exact Jaccard of character 5-gram *string* sets over every pair of distinct texts.

Prints JSON and a table: documents/s per core of the whole stage (Ray, all steps, writing
included) and of signature+LSH alone (one process), side by side with datasketch at the same
num_perm and threshold; precision and recall of the stage's confirmed pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import CorpusConfig  # noqa: E402
from pipeline.datasets import materialize_corpus  # noqa: E402
from stages import corpus  # noqa: E402
from stages.minhash import MinHasher, band_keys, candidate_pairs, lsh_params, normalize  # noqa: E402


def make_corpus(root: Path, editions: int, seed: int) -> tuple[list[str], list[str]]:
    """(texts, doc_ids) of news.jsonl + editions.jsonl written under root."""
    news = materialize_corpus("news", root / "news")
    texts = [json.loads(line)["text"] for line in open(news)]
    ids = [corpus.doc_id(str(news), i) for i in range(len(texts))]
    rng = np.random.default_rng(seed)
    edited = []
    for k in rng.choice(len(texts), editions, replace=True):
        words = texts[k].split(" ")
        frac = rng.uniform(0.0, 0.2)  # 0-20% of words replaced: Jaccard ~0.4-1.0
        for w in rng.choice(len(words), int(frac * len(words)), replace=False):
            words[w] = f"e{rng.integers(10**7)}"
        edited.append(" ".join(words))
    path = root / "editions.jsonl"
    with open(path, "w") as f:
        for t in edited:
            f.write(json.dumps({"text": t}) + "\n")
    ids += [corpus.doc_id(str(path), i) for i in range(len(edited))]
    return texts + edited, ids


def exact_survivors(texts: list[str], ids: list[str]) -> list[int]:
    """Indices kept by exact dedup (smallest doc_id per normalised text), as the stage does."""
    best: dict[str, int] = {}
    for i, t in enumerate(texts):
        n = normalize(t)
        if n and (n not in best or ids[i] < ids[best[n]]):
            best[n] = i
    return sorted(best.values())


def true_pairs(texts: list[str], floor: float) -> dict[tuple[int, int], float]:
    """Brute force: Jaccard of exact 5-gram string sets for every pair; those >= floor."""
    from scipy import sparse

    vocab: dict[str, int] = {}
    rows, cols = [], []
    for i, t in enumerate(texts):
        n = normalize(t)
        grams = {n[k:k + 5] for k in range(max(len(n) - 4, 1))}
        cols.extend(vocab.setdefault(g, len(vocab)) for g in grams)
        rows.extend([i] * len(grams))
    a = sparse.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(texts), len(vocab)))
    size = np.asarray(a.sum(axis=1)).ravel()
    out = {}
    for start in range(0, len(texts), 500):  # (500, N) dense block of intersections
        inter = (a[start:start + 500] @ a.T).toarray()
        jac = inter / (size[start:start + 500, None] + size[None, :] - inter)
        for i, j in zip(*np.nonzero(jac >= floor)):
            if start + i < j:
                out[(start + i, int(j))] = float(jac[i, j])
    return out


def ours_signature_lsh(texts: list[str], num_perm: int, threshold: float) -> tuple[float, set]:
    start = time.perf_counter()
    hasher = MinHasher(num_perm=num_perm)
    bands, rows = lsh_params(threshold, num_perm)
    sigs = hasher.signatures([normalize(t) for t in texts])
    pairs = candidate_pairs(band_keys(sigs, bands, rows))
    return time.perf_counter() - start, pairs


def datasketch_signature_lsh(texts: list[str], num_perm: int, threshold: float) -> tuple[float, set]:
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    pairs = set()
    for i, t in enumerate(texts):
        n = normalize(t)
        m = MinHash(num_perm=num_perm)
        m.update_batch([n[k:k + 5].encode() for k in range(max(len(n) - 4, 1))])
        for j in lsh.query(m):
            pairs.add((j, i))
        lsh.insert(i, m)
    return time.perf_counter() - start, pairs


def run_stage(root: Path, cpus: int, cfg: CorpusConfig) -> tuple[float, dict, list[tuple[str, str, float]]]:
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
    start = time.perf_counter()
    result = corpus.run(cfg, inputs={"raw": corpus.RawCorpus((str(root / "news"), str(root / "editions.jsonl")))},
                        out=out, ctx=ctx)
    wall = time.perf_counter() - start
    ray.shutdown()
    edges = pq.read_table(out / "near_pairs.parquet").to_pylist()
    return wall, result.counts, [(e["a"], e["b"], e["similarity"]) for e in edges]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--editions", type=int, default=1000, help="edited versions of random articles to add")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray running the stage")
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-truth", action="store_true",
                   help="skip the brute-force ground truth (quadratic: minutes beyond ~10k documents); "
                        "throughputs only, precision and recall left out")
    p.add_argument("--stage-only", action="store_true",
                   help="time the stage alone (large --editions: fixed Ray costs amortised); no comparison")
    args = p.parse_args()
    cfg = CorpusConfig(num_perm=args.num_perm, threshold=args.threshold)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts, ids = make_corpus(root, args.editions, args.seed)
        stage_s, counts, edges = run_stage(root, args.cpus, cfg)
    if args.stage_only:
        print(json.dumps({"documents": len(texts), "cpus": args.cpus, "stage_wall_s": round(stage_s, 2),
                          "stage_docs_per_s_per_core": round(len(texts) / stage_s / args.cpus, 1),
                          "counts": counts}, indent=2))
        return

    keep = exact_survivors(texts, ids)  # near dedup runs on these, in the stage and here
    sub = [texts[i] for i in keep]
    index = {ids[i]: n for n, i in enumerate(keep)}
    ours_s, ours_cand = ours_signature_lsh(sub, args.num_perm, args.threshold)
    ds_s, ds_cand = datasketch_signature_lsh(sub, args.num_perm, args.threshold)
    start = time.perf_counter()
    truth = {} if args.no_truth else true_pairs(sub, 0.5)
    brute_s = time.perf_counter() - start

    found = {tuple(sorted((index[a], index[b]))) for a, b, _ in edges}
    t7 = {k for k, v in truth.items() if v >= args.threshold}
    t8 = {k for k, v in truth.items() if v >= 0.8}

    def pr(pairs: set) -> dict:
        pairs = {tuple(sorted(x)) for x in pairs}
        if args.no_truth:
            return {"pairs": len(pairs), "precision": "-", "recall_j>=0.8": "-", f"recall_j>={args.threshold}": "-"}
        return {"pairs": len(pairs),
                "precision": round(len(pairs & t7) / max(len(pairs), 1), 4),
                "recall_j>=0.8": round(len(pairs & t8) / max(len(t8), 1), 4),
                f"recall_j>={args.threshold}": round(len(pairs & t7) / max(len(t7), 1), 4)}

    n = len(texts)
    bands, rows = lsh_params(args.threshold, args.num_perm)
    report = {
        "documents": n, "documents_after_exact": len(sub),
        **({} if args.no_truth else {"true_pairs_j>=0.8": len(t8), f"true_pairs_j>={args.threshold}": len(t7)}),
        "num_perm": args.num_perm, "threshold": args.threshold,
        "bands_x_rows": f"{bands}x{rows}", "cpus": args.cpus,
        "stage": {"wall_s": round(stage_s, 2), "docs_per_s_per_core": round(n / stage_s / args.cpus, 1),
                  **pr(found), "counts": counts},
        "ours_signature_lsh": {"wall_s": round(ours_s, 2), "docs_per_s_per_core": round(len(sub) / ours_s, 1),
                               **pr(ours_cand)},
        "datasketch_signature_lsh": {"wall_s": round(ds_s, 2), "docs_per_s_per_core": round(len(sub) / ds_s, 1),
                                     **pr(ds_cand)},
        "speedup_signature_lsh_per_core": round(ds_s / ours_s, 2),
        **({} if args.no_truth else {"brute_force_s": round(brute_s, 1)}),
    }
    print(json.dumps(report, indent=2))
    print()
    print(f"{'':28}{'docs/s/core':>12}{'pairs':>8}{'precision':>11}{'recall>=0.8':>13}{'recall>=' + str(args.threshold):>13}")
    for name, key in (("stage (Ray, confirmed)", "stage"), ("ours: signature+LSH", "ours_signature_lsh"),
                      ("datasketch: MinHashLSH", "datasketch_signature_lsh")):
        r = report[key]
        print(f"{name:28}{r['docs_per_s_per_core']:>12}{r['pairs']:>8}{r['precision']:>11}{r['recall_j>=0.8']:>13}"
              f"{r[f'recall_j>={args.threshold}']:>13}")
    print("(LSH rows are unconfirmed candidates; the stage confirms each by exact Jaccard)")


if __name__ == "__main__":
    main()
