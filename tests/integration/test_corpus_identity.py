"""What identifies a raw corpus file: an edit in place that keeps its size and modification time (a typo fixed,
then `touch -r` back) still gives the corpus a new id, so `python -m pipeline.run` re-runs the corpus stage; a new
modification time alone gives a new id too (path, size, mtime and content all count). Read from the plan on paper
(`--dry-run`), which resolves the corpus exactly as a run does, before Ray starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipeline.run import main


def corpus_plan(corpus: Path, workdir: Path, capsys) -> tuple[str, str]:
    """(artifact id, state) of the corpus stage in the `--dry-run` plan."""
    capsys.readouterr()
    assert main(["--corpus", str(corpus), "--workdir", str(workdir), "--until", "corpus", "--dry-run"]) == 0
    (row,) = re.findall(r"^  corpus\s+([0-9a-f]{16})  (.+)$", capsys.readouterr().out, re.M)
    return row


def test_an_edit_keeping_size_and_mtime_gives_a_new_corpus_id(news_subset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    corpus = tmp_path / "news.jsonl"
    corpus.write_bytes(news_subset(40).read_bytes())
    first, state = corpus_plan(corpus, tmp_path / "wd", capsys)
    assert state == "run" and corpus_plan(corpus, tmp_path / "wd", capsys) == (first, "run")  # stable
    before = os.stat(corpus)
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    old_word = next(w for w in docs[0]["text"].split() if len(w) >= 6 and w.isalpha())
    new_word = old_word[::-1] if old_word[::-1] != old_word else old_word.upper()
    docs[0]["text"] = docs[0]["text"].replace(old_word, new_word, 1)
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(corpus)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    edited, state = corpus_plan(corpus, tmp_path / "wd", capsys)
    assert state == "run" and edited != first, (first, edited)
    # the same bytes with another mtime: a new id as well (touch alone re-runs; what a run reads is what it names)
    os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    touched, _ = corpus_plan(corpus, tmp_path / "wd", capsys)
    assert touched not in (first, edited)
    assert not (tmp_path / "wd").exists()  # a plan on paper writes nothing
