"""Object storage, against a real S3 server on loopback (tests/s3_server.py).

- A corpus in a bucket: the corpus stage lists and reads `s3://bucket/prefix/` through pyarrow.fs in Ray Data's tasks,
  with nothing staged on local disk, and keeps what a local copy of the same files keeps.
- A workdir in a bucket: artifacts are uploaded with their marker last and read back through a verified local copy;
  the same input gives the same ids and files as a local workdir; a re-run from another machine's empty local
  directory reuses every artifact without downloading it; an object cut short is named before any stage; a
  connection lost mid-upload leaves no artifact, and the same build again finishes it.
- Credentials and endpoint come from the standard AWS environment; each way they can be wrong is one `error:` line
  naming the URI and the fix, before any stage."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from core.artifacts import MANIFEST, SUCCESS, ArtifactStore
from core.errors import StageInputError
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


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.run([sys.executable, "-m", "pipeline.run", *args, "--set", "ray.num_cpus=2",
                           "--set", "ray.dashboard=false"],
                          cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=600)


def _summary(out: str) -> dict[str, tuple[str, str]]:
    """stage -> (artifact id, "ran" | "cached") from the run's summary."""
    rows = [ln.split() for ln in out.split("=== summary ===")[1].splitlines() if ln.startswith("  ")]
    return {r[0]: (r[1], r[2].strip("()")) for r in rows if len(r) >= 3 and r[2] in ("(ran)", "(cached)")}


def _files(manifest: dict) -> dict[str, str]:
    return {rel: f["sha256"] for rel, f in manifest["files"].items()}


def test_a_corpus_and_a_workdir_in_a_bucket(s3_server, corpus_files, tmp_path):  # noqa: F811
    fs, bucket = s3_server.filesystem(), s3_server.bucket
    for path in corpus_files.iterdir():
        with fs.open_output_stream(f"{bucket}/news/{path.name}", compression=None) as out:  # as is
            out.write(path.read_bytes())
    # the same input, the corpus in the bucket, built into a local workdir and into a workdir in the bucket
    local, s3, corpus = tmp_path / "local", f"s3://{bucket}/wd", f"s3://{bucket}/news/"
    in_bucket = ["--corpus", corpus, "--workdir", s3]
    runs = {"local": ["--corpus", corpus, "--workdir", str(local), "--until", "tokenize"],
            "s3-workdir": [*in_bucket, "--local-dir", str(tmp_path / "l1"), "--until", "tokenize"]}
    outs = {}
    for name, args in runs.items():
        res = _run(args, s3_server.env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        outs[name] = res.stdout

    # the corpus read from the bucket: its 200 distinct texts kept, the 20 exact repeats removed, nothing staged
    distinct = sorted({json.loads(line)["text"] for f in ("a.jsonl", "b.jsonl.gz")
                       for line in (gzip.open if f.endswith(".gz") else open)(corpus_files / f, "rt")})
    assert len(distinct) == 200 and _corpus_texts(local) == distinct
    assert "corpus: 200 of 220 documents kept (20 exact" in outs["local"], outs["local"][-2000:]
    assert not any(str(p).endswith((".jsonl", ".gz")) for p in local.rglob("*")), "staged locally"

    # the workdir in the bucket: the same ids as on disk, every artifact complete there, its files those of disk
    ran = _summary(outs["s3-workdir"])
    assert ran == _summary(outs["local"]) and {how for _, how in ran.values()} == {"ran"}, (ran, outs["local"][-1500:])
    assert _corpus_texts(tmp_path / "l1") == distinct
    for stage in ("corpus", "vocab", "tokenize"):
        art_id = ran[stage][0]
        remote = json.loads(fs.open_input_stream(f"{bucket}/wd/artifacts/{stage}/{art_id}/{MANIFEST}").read())
        on_disk = json.loads((local / "artifacts" / stage / art_id / MANIFEST).read_text())
        timed = {"report.json"} if stage == "corpus" else set()  # the corpus report holds the run's timings
        assert _files(remote).keys() == _files(on_disk).keys(), stage
        assert {k: v for k, v in _files(remote).items() if k not in timed} == \
            {k: v for k, v in _files(on_disk).items() if k not in timed}, stage
        assert fs.get_file_info(f"{bucket}/wd/artifacts/{stage}/{art_id}/{SUCCESS}").size == 0

    # another machine (an empty local directory) reuses every artifact without downloading any, and without Ray
    res = _run([*in_bucket, "--local-dir", str(tmp_path / "l2"), "--until", "tokenize"], s3_server.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert {how for _, how in _summary(res.stdout).values()} == {"cached"}, res.stdout[-2000:]
    assert "started a local Ray" not in res.stdout
    assert not (tmp_path / "l2" / "artifacts").exists() or not any((tmp_path / "l2" / "artifacts").rglob("*.arrow"))

    # a token shard cut short in the bucket is named before any stage runs, and the fix is said
    shard = f"{bucket}/wd/artifacts/tokenize/{ran['tokenize'][0]}/train/part-00000-000.arrow"
    data = fs.open_input_stream(shard).read()
    with fs.open_output_stream(shard, compression=None) as out:
        out.write(data[: len(data) // 2])
    # (one pretraining worker: the plan then fits this run's 2 Ray CPUs, so the shard is what it refuses)
    res = _run([*in_bucket, "--local-dir", str(tmp_path / "l3"), "--until", "pretrain",
                "--set", "pretrain.num_workers=1"], s3_server.env)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(lines) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"s3://{shard} has {len(data) // 2} bytes, its manifest says {len(data)}" in lines[0], lines
    assert "--force tokenize" in lines[0] and "running ->" not in res.stdout
    assert not (tmp_path / "l3").exists()  # a refused run leaves nothing of its own

    # runs sharing a workdir in a bucket lock through their --local-dir: a live run holding tokenize's lock there
    # refuses a second one; once it is gone, --force rebuilds the damaged artifact from the bucket's corpus and
    # vocab (fetched to this directory and verified), and the bucket holds the same files as before the damage
    force = [*in_bucket, "--local-dir", str(tmp_path / "l4"), "--until", "tokenize", "--force", "tokenize"]
    lock = tmp_path / "l4" / "locks" / f"tokenize-{ran['tokenize'][0]}.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from core import locks; "
                               "locks.acquire(sys.argv[1]); print('held', flush=True); time.sleep(300)", str(lock)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = _run(force, s3_server.env)
        assert res.returncode == 2 and "is being built by another run" in res.stderr, res.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait()
    res = _run(force, s3_server.env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _summary(res.stdout) == {**{k: (v[0], "cached") for k, v in ran.items()}, "tokenize": ran["tokenize"]}
    assert (tmp_path / "l4" / "artifacts" / "vocab" / ran["vocab"][0] / SUCCESS).is_file()  # fetched to read it
    remote = json.loads(fs.open_input_stream(f"{bucket}/wd/artifacts/tokenize/{ran['tokenize'][0]}/{MANIFEST}").read())
    assert _files(remote) == _files(json.loads((local / "artifacts" / "tokenize" / ran["tokenize"][0] / MANIFEST)
                                               .read_text()))
    assert fs.get_file_info(shard).size == len(data)


def test_an_artifact_in_a_bucket_is_visible_whole_and_read_verified(s3_server, news_subset, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    import pyarrow.fs as pafs

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    fs, workdir = s3_server.filesystem(), f"s3://{s3_server.bucket}/store"
    text = news_subset(50).read_bytes()
    writer = ArtifactStore(workdir, tmp_path / "writer")
    with writer.building("corpus", "a1", {"stage": "corpus"}) as out:
        (out / "train").mkdir()
        (out / "train" / "part-0.jsonl").write_bytes(text)
        (out / "report.json").write_text("{}")
        assert not writer.exists("corpus", "a1")  # not visible while being written
    root = f"{s3_server.bucket}/store/artifacts/corpus/a1"
    assert fs.open_input_stream(f"{root}/train/part-0.jsonl").read() == text

    # another machine: found in the bucket, copied, every byte the writer's
    reader = ArtifactStore(workdir, tmp_path / "reader")
    art = reader.find("corpus", "a1")
    assert art is not None and art.path == tmp_path / "reader" / "artifacts" / "corpus" / "a1"
    assert (art.path / "train" / "part-0.jsonl").read_bytes() == text
    assert art.uri == f"{workdir}/artifacts/corpus/a1" and art.manifest["files"]["train/part-0.jsonl"]["bytes"] == len(text)

    # an upload cut short (objects, no marker) is no artifact
    with fs.open_output_stream(f"{s3_server.bucket}/store/artifacts/corpus/a2/train/part-0.jsonl") as out:
        out.write(text)
    assert not reader.exists("corpus", "a2") and reader.find("corpus", "a2") is None

    # an object changed in the bucket: a size change is seen by listing; equal size, other bytes when copied
    with fs.open_output_stream(f"{root}/train/part-0.jsonl", compression=None) as out:
        out.write(text[:-10])
    fresh = ArtifactStore(workdir, tmp_path / "fresh")
    with pytest.raises(StageInputError, match=rf"part-0.jsonl has {len(text) - 10} bytes, .*--force corpus"):
        fresh.verify("corpus", "a1")
    with fs.open_output_stream(f"{root}/train/part-0.jsonl", compression=None) as out:
        out.write(text[:-10] + b"x" * 10)
    fresh.verify("corpus", "a1")  # sizes agree
    with pytest.raises(StageInputError, match=r"part-0.jsonl does not match its manifest's sha256.*--force corpus"):
        fresh.find("corpus", "a1")
    assert not list((tmp_path / "fresh" / "artifacts" / "corpus").iterdir())  # no partial copy left

    # a second build of the damaged artifact keeps it; --force (replace) puts the new one in its place whole
    with writer.building("corpus", "a1", {"stage": "corpus"}) as out:
        (out / "other.txt").write_text("not kept")
    assert not fs.get_file_info(f"{root}/other.txt").is_file
    with ArtifactStore(workdir, tmp_path / "forcer").building("corpus", "a1", {"stage": "corpus"}, replace=True) as out:
        (out / "report.json").write_text('{"forced": true}')
    names = {i.path[len(root) + 1:] for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)) if i.is_file}
    assert names == {"report.json", MANIFEST, SUCCESS}, names  # the old objects gone, the marker last in
    forced = ArtifactStore(workdir, tmp_path / "after-force").find("corpus", "a1")
    assert (forced.path / "report.json").read_text() == '{"forced": true}'


def test_a_connection_lost_mid_upload_leaves_no_artifact_and_the_rerun_finishes_it(s3_server, news_subset,  # noqa: F811
                                                                                  tmp_path, monkeypatch):
    """The link to the server drops halfway through an artifact's upload (a real TCP cut, tests/net_cut.py): the
    build fails, the objects already sent are no artifact to any reader, and the same build again, with the link
    back, uploads it whole over them."""
    import pyarrow.fs as pafs

    from tests.net_cut import cut_after

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    fs, workdir = s3_server.filesystem(), f"s3://{s3_server.bucket}/cut"
    root = f"{s3_server.bucket}/cut/artifacts/corpus/c1"
    parts = {f"train/part-{i}.jsonl": news_subset(30 + i).read_bytes() for i in range(8)}

    def build(store: ArtifactStore) -> None:
        with store.building("corpus", "c1", {"stage": "corpus"}) as out:
            for rel, data in parts.items():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_bytes(data)

    endpoint = s3_server.env["AWS_ENDPOINT_URL"].rsplit(":", 1)
    with cut_after(sum(map(len, parts.values())) // 2, endpoint[0].removeprefix("http://"), int(endpoint[1])) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        writer = ArtifactStore(workdir, tmp_path / "writer")
        with pytest.raises(OSError):
            build(writer)
    assert proxy.cut.is_set()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.env["AWS_ENDPOINT_URL"])
    sent = {i.path for i in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)) if i.is_file}
    assert sent and f"{root}/{SUCCESS}" not in sent  # some objects went up before the cut; the marker did not
    reader = ArtifactStore(workdir, tmp_path / "reader")
    assert not reader.exists("corpus", "c1") and reader.find("corpus", "c1") is None
    assert not list((tmp_path / "writer" / "artifacts" / "corpus").iterdir())  # no local build left either

    build(writer)
    art = ArtifactStore(workdir, tmp_path / "after").find("corpus", "c1")  # fetched and verified against its manifest
    assert {rel: (art.path / rel).read_bytes() for rel in parts} == parts


@pytest.mark.parametrize("wrong, fragment", [
    ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "the credentials were refused: check AWS_ACCESS_KEY_ID"),
    ({}, "the bucket does not exist: check its name, or create it"),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "the endpoint cannot be reached: check AWS_ENDPOINT_URL"),
], ids=["wrong-key", "missing-bucket", "unreachable-endpoint"])
@pytest.mark.parametrize("what", ["corpus", "workdir"])
def test_a_bucket_that_cannot_be_used_is_one_line_before_any_stage(s3_server, what, wrong, fragment,  # noqa: F811
                                                                    tmp_path):
    uri = f"s3://{'no-such-bucket' if not wrong else s3_server.bucket}/{what}/"
    args = (["--corpus", uri, "--workdir", str(tmp_path / "wd")] if what == "corpus"
            else ["--workdir", uri, "--local-dir", str(tmp_path / "wd")])
    res = pipeline_main(args, {**s3_server.env, **wrong})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert lines[0].startswith(f"error: {what} {uri}: {fragment}"), lines
    assert not (tmp_path / "wd").exists()


def test_registered_models_live_in_the_bucket(s3_server, tiny_pretrained, tmp_path, monkeypatch):  # noqa: F811
    """An MLflow server whose artifact store is the bucket (`--artifacts-destination s3://...`, the server holding
    the credentials; clients upload through it): a pretrained model registered as the pretrain stage registers it
    is stored there, and `finetune.init=models:/NAME/VERSION` reads it back whole."""
    import pyarrow.fs as pafs

    from core.lineage import Lineage
    from core.registry import download_registered_model
    from deberta import checkpoint, hf
    from deberta.model import DebertaForMaskedLM
    from tests.conftest import MlflowServer

    pretrain, vocab = tiny_pretrained
    mlm = DebertaForMaskedLM(checkpoint.load_config(pretrain.path / "model"))
    checkpoint.load_into(mlm, pretrain.path / "model")
    hf_dir = hf.save_pretrained(mlm, tmp_path / "hf", vocab_dir=vocab.path)
    server = MlflowServer(tmp_path / "mlflow", artifacts=f"s3://{s3_server.bucket}/mlflow", env=s3_server.env)
    (tmp_path / "mlflow").mkdir()
    server.start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        lineage = Lineage(tmp_path / "wd")
        lineage.start("pipeline-s3", {"preset": "debug"}, ["pretrain"])
        tracker = lineage.stage_run("pretrain", "p1", {}, {}, cached=False)
        uri = tracker.log_hf_model(hf_dir, task="fill-mask", name="pretrained",
                                   input_example={"text": ["a [MASK] review"]})
        version = tracker.register_model("deberta-s3-pretrained", model_uri=uri)
        fs = s3_server.filesystem()
        stored = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/mlflow",
                                                                                   recursive=True))}
        weights = (Path(hf_dir) / "model.safetensors").read_bytes()
        assert stored.get("model.safetensors") == len(weights), sorted(stored)
        export = download_registered_model(f"models:/deberta-s3-pretrained/{version}", tmp_path / "reader")
        assert (Path(export.path) / "model.safetensors").read_bytes() == weights
    finally:
        server.stop()
