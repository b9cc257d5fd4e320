"""What identifies a raw corpus file: an edit in place that keeps its size and modification time (a typo fixed,
then `touch -r` back) still re-runs the corpus stage, through `python -m pipeline.run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray]


def corpus_run(corpus: Path, workdir: Path) -> tuple[str, Path]:
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--corpus", str(corpus), "--workdir", str(workdir),
                          "--until", "corpus"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, MLFLOW_TRACKING_URI=""))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    state = next(ln for ln in res.stdout.splitlines() if ln.startswith("  corpus "))
    return state, workdir / "artifacts" / "corpus" / state.split()[1]


def test_an_edit_keeping_size_and_mtime_reruns_the_corpus_stage(news_subset, tmp_path):
    corpus = tmp_path / "news.jsonl"
    corpus.write_bytes(news_subset(40).read_bytes())
    first, art = corpus_run(corpus, tmp_path / "wd")
    assert first.endswith(" run")
    before = os.stat(corpus)
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    old_word = next(w for w in docs[0]["text"].split() if len(w) >= 6 and w.isalpha())
    new_word = old_word[::-1] if old_word[::-1] != old_word else old_word.upper()
    docs[0]["text"] = docs[0]["text"].replace(old_word, new_word, 1)
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(corpus)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second, edited = corpus_run(corpus, tmp_path / "wd")
    assert second.endswith(" run") and edited != art, second
    texts = [t for split in ("train", "validation") for t in pq.read_table(edited / split).column("text").to_pylist()]
    assert any(new_word in t for t in texts) and not any(t == docs[0]["text"].replace(new_word, old_word, 1)
                                                         for t in texts)
