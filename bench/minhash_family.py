"""The MinHash permutation family and block size the corpus stage uses, against the textbook ones, on real text.

    .venv/bin/python -m bench.minhash_family                  # ~1 min, one core; bench/results/minhash_family.json

The stage's signature is min over shingles of (a_i * x) mod 2^32 (x: the top 32 bits of a shingle's mixed 64-bit
hash, a_i odd), computed in (permutations x SIGNATURE_CHUNK) blocks. Two questions, each answered here:
- quality: does leaving out the textbook family's "+ b_i" change the estimator? For `--seeds` seeds (each a new set
  of permutations), `--pairs` pairs of a built-in news article and an edit of it (1-40% of the words replaced), the
  error of the estimated Jaccard (the share of equal signature values) against the exact Jaccard of the shingle
  sets: its mean over the pairs (a seed's bias) and its root mean square over the binomial sqrt(J(1-J)/P);
- speed: CPU seconds of the signatures of `--docs` documents of the news corpus, both families, at the stage's
  block and at the 16,384-shingle block it used before.
The "+ b" family is written here (the stage no longer has it): the same loop as `MinHasher.signatures_of_hashes`,
with the add.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, command_line, emit, load_average
from stages.corpus import minhash
from stages.corpus.minhash import MinHasher, batch_shingles, jaccard_pairs, lsh_params, normalize, shingle_sets


def signatures_plus_b(hasher: MinHasher, hashes: np.ndarray, offsets: np.ndarray, b: np.ndarray,
                      perms: int, chunk: int) -> np.ndarray:
    """(N, perms) min over shingles of (a_i * x + b_i) mod 2^32: the textbook family, blocked like the stage."""
    n, a, b = len(offsets) - 1, hasher._a[:perms], b[:perms, None]
    sig = np.full((n, perms), 0xFFFFFFFF, dtype=np.uint32)
    counts = np.diff(offsets)
    doc_of = np.repeat(np.arange(n), counts)
    x = (hashes >> np.uint64(32)).astype(np.uint32)[None, :]
    buf = np.empty((perms, min(chunk, max(x.shape[1], 1))), dtype=np.uint32)
    for c0 in range(0, x.shape[1], chunk):
        c1 = min(c0 + chunk, x.shape[1])
        vals = buf[:, :c1 - c0]
        np.multiply(a, x[:, c0:c1], out=vals)
        vals += b
        docs = np.arange(doc_of[c0], doc_of[c1 - 1] + 1)
        docs = docs[counts[docs] > 0]
        mins = np.minimum.reduceat(vals, np.maximum(offsets[docs], c0) - c0, axis=1)
        sig[docs] = np.minimum(sig[docs], mins.T)
    return sig


def edited(text: str, fraction: float, rng: np.random.Generator) -> str:
    words = text.split(" ")
    for k in rng.choice(len(words), int(fraction * len(words)), replace=False):
        words[k] = f"w{rng.integers(10**6)}"
    return " ".join(words)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--pairs", type=int, default=800)
    p.add_argument("--docs", type=int, default=3000, help="news documents whose signatures are timed")
    p.add_argument("--repeats", type=int, default=5, help="timings: the best of this many")
    p.add_argument("--json", default=str(RESULTS / "minhash_family.json"))
    args = p.parse_args()

    from core.datasets import materialize_corpus

    texts = [json.loads(line)["text"] for line in open(materialize_corpus("news", Path(tempfile.mkdtemp())))]
    rng = np.random.default_rng(0)
    docs = [t for t in texts if len(t) > 300][:args.pairs]
    a_texts = [normalize(t) for t in docs]
    b_texts = [normalize(edited(t, rng.uniform(0.01, 0.4), rng)) for t in docs]
    values, offsets = shingle_sets(a_texts + b_texts)
    n = len(a_texts)
    exact = jaccard_pairs(values, offsets, np.arange(n), np.arange(n) + n)
    binomial = np.sqrt(np.mean(exact * (1 - exact) / 128))
    hashes, hash_offsets = batch_shingles(a_texts + b_texts)
    quality = {}
    for family in ("a*x", "a*x+b"):
        bias, rms = [], []
        for seed in range(args.seeds):
            hasher = MinHasher(num_perm=128, seed=seed)
            if family == "a*x":
                sig = hasher.signatures_of_hashes(hashes, hash_offsets)
            else:
                b = np.random.default_rng([seed, 1]).integers(0, 1 << 32, 128, dtype=np.uint64).astype(np.uint32)
                sig = signatures_plus_b(hasher, hashes, hash_offsets, b, 128, minhash.SIGNATURE_CHUNK)
            err = (sig[:n] == sig[n:]).mean(axis=1) - exact
            bias.append(float(err.mean()))
            rms.append(float(np.sqrt((err ** 2).mean()) / binomial))
        quality[family] = {"bias_mean": round(float(np.mean(bias)), 5),
                           "bias_std_over_seeds": round(float(np.std(bias)), 5),
                           "bias_standard_error": round(float(np.std(bias) / np.sqrt(args.seeds)), 5),
                           "rms_over_binomial_mean": round(float(np.mean(rms)), 4),
                           "rms_over_binomial_max": round(float(np.max(rms)), 4)}

    timed = [normalize(t) for t in texts[:args.docs]]
    bands, rows = lsh_params(0.7, 128)
    perms = bands * rows
    hashes, hash_offsets = batch_shingles(timed)
    hasher = MinHasher(num_perm=128, seed=0)
    b = np.random.default_rng([0, 1]).integers(0, 1 << 32, 128, dtype=np.uint64).astype(np.uint32)

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return min(times)

    stage_chunk = minhash.SIGNATURE_CHUNK
    speed = {}
    for chunk in (stage_chunk, 16_384):
        minhash.SIGNATURE_CHUNK = chunk
        speed[f"a*x, block {chunk}"] = best(lambda: hasher.signatures_of_hashes(hashes, hash_offsets, perms))
        speed[f"a*x+b, block {chunk}"] = best(
            lambda: signatures_plus_b(hasher, hashes, hash_offsets, b, perms, chunk))
    minhash.SIGNATURE_CHUNK = stage_chunk
    shingles = int(len(hashes))
    report = {
        "bench": "minhash_family", "command": command_line(), "load_average": load_average(),
        "pairs": n, "seeds": args.seeds, "num_perm": 128, "binomial_rms": round(float(binomial), 5),
        "quality": quality,
        "speed": {"documents": len(timed), "shingles": shingles, "permutations": perms,
                  "cpu_s": {k: round(v, 4) for k, v in speed.items()},
                  "ns_per_shingle_permutation": {k: round(v / shingles / perms * 1e9, 3) for k, v in speed.items()},
                  "stage_vs_before": round(speed["a*x+b, block 16384"] / speed[f"a*x, block {stage_chunk}"], 2)},
    }
    lines = ["family   bias mean  bias std (seeds)  rms / binomial (mean, max)"]
    lines += [f"{k:8s} {v['bias_mean']:+.5f}   {v['bias_std_over_seeds']:.5f}           "
              f"{v['rms_over_binomial_mean']:.4f}, {v['rms_over_binomial_max']:.4f}" for k, v in quality.items()]
    lines += ["", "signatures of %d documents (%d permutations): CPU s, ns per (shingle, permutation)" % (len(timed), perms)]
    lines += [f"  {k:22s} {v:.4f} s  {report['speed']['ns_per_shingle_permutation'][k]:.3f} ns" for k, v in speed.items()]
    lines += [f"the stage's (a*x, block {stage_chunk}) vs the textbook family at the old block: "
              f"{report['speed']['stage_vs_before']}x faster"]
    emit(report, Path(args.json) if args.json else None, "\n".join(lines))


if __name__ == "__main__":
    main()
