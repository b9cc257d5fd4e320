"""A corpus in object storage, read by the pipeline from a real S3 server on loopback (tests/s3_server.py): the
corpus stage lists and reads `s3://bucket/prefix/` through pyarrow.fs in Ray Data's tasks, with nothing staged on
local disk, and keeps what a local copy of the same files keeps; credentials and endpoint come from the standard AWS
environment, and each way they can be wrong is one `error:` line naming the URI and the fix, before any stage."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import pipeline_main
from tests.s3_server import s3_server  # noqa: F401  (the session's server)

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray]


def _corpus_texts(workdir: Path) -> list[str]:
    """Every document the corpus stage kept (train and validation), sorted."""
    (art,) = (workdir / "artifacts" / "corpus").iterdir()
    return sorted(t for split in ("train", "validation") for f in sorted((art / split).glob("*.parquet"))
                  for t in pq.read_table(f, columns=["text"]).column("text").to_pylist())


@pytest.fixture(scope="module")
def corpus_files(news_subset, tmp_path_factory) -> Path:
    """200 real news articles as two files: plain JSONL with the first 140, and gzipped JSONL with the other 60 and
    repeats of the first 20 (exact duplicates for the stage to remove): 220 documents, 200 distinct."""
    lines = news_subset(200).read_text().splitlines(keepends=True)
    root = tmp_path_factory.mktemp("local-corpus")
    (root / "a.jsonl").write_text("".join(lines[:140]))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.write("".join(lines[140:] + lines[:20]))
    return root


def test_a_corpus_in_a_bucket_is_read_as_its_local_copy(s3_server, corpus_files, tmp_path):  # noqa: F811
    fs = s3_server.filesystem()
    for path in corpus_files.iterdir():
        with fs.open_output_stream(f"{s3_server.bucket}/news/{path.name}", compression=None) as out:  # as is
            out.write(path.read_bytes())
    runs = {}
    for name, corpus in (("s3", f"s3://{s3_server.bucket}/news/"), ("local", str(corpus_files))):
        workdir = tmp_path / name
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        res = subprocess.run([sys.executable, "-m", "pipeline.run", "--corpus", corpus, "--workdir", str(workdir),
                              "--until", "corpus", "--set", "ray.num_cpus=2", "--set", "ray.dashboard=false"],
                             cwd=REPO, env={**env, **s3_server.env}, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[name] = (_corpus_texts(workdir), res.stdout)
    (s3_texts, s3_out), (local_texts, _) = runs["s3"], runs["local"]
    assert len(s3_texts) == 200 and s3_texts == local_texts  # the 20 repeats removed, the same 200 kept
    assert "corpus: 200 of 220 documents kept (20 exact" in s3_out, s3_out[-2000:]
    assert not any(str(p).endswith((".jsonl", ".gz")) for p in (tmp_path / "s3").rglob("*")), "staged locally"


@pytest.mark.parametrize("wrong, fragment", [
    ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "the credentials were refused: check AWS_ACCESS_KEY_ID"),
    ({}, "the bucket does not exist: check its name, or create it"),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "the endpoint cannot be reached: check AWS_ENDPOINT_URL"),
], ids=["wrong-key", "missing-bucket", "unreachable-endpoint"])
def test_a_bucket_that_cannot_be_read_is_one_line_before_any_stage(s3_server, wrong, fragment, tmp_path):  # noqa: F811
    bucket = "no-such-bucket" if not wrong else s3_server.bucket
    uri = f"s3://{bucket}/news/"
    res = pipeline_main(["--corpus", uri, "--workdir", str(tmp_path / "wd")], {**s3_server.env, **wrong})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert lines[0].startswith(f"error: corpus {uri}: {fragment}"), lines
    assert not (tmp_path / "wd").exists()
