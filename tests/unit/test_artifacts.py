"""Artifact ids are stable and sensitive; artifacts appear atomically or not at all."""

import hashlib
import json

import pytest

from core.artifacts import SUCCESS, ArtifactStore, artifact_id
from pipeline.plan import STAGES
from pipeline.presets import PRESETS


def test_id_stable_and_sensitive():
    base = artifact_id("vocab", "1", {"vocab_size": 8000, "seed": 0}, {"corpus": "abc"})
    assert base == artifact_id("vocab", "1", {"seed": 0, "vocab_size": 8000}, {"corpus": "abc"})  # key order
    assert base != artifact_id("vocab", "1", {"vocab_size": 8001, "seed": 0}, {"corpus": "abc"})  # config
    assert base != artifact_id("vocab", "1", {"vocab_size": 8000, "seed": 0}, {"corpus": "abd"})  # input
    assert base != artifact_id("vocab", "2", {"vocab_size": 8000, "seed": 0}, {"corpus": "abc"})  # version
    assert base != artifact_id("tokenize", "1", {"vocab_size": 8000, "seed": 0}, {"corpus": "abc"})  # stage


def test_atomic_build_success(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.building("corpus", "id1", {"stage": "corpus"}) as out:
        (out / "train").mkdir()
        (out / "train" / "a.txt").write_text("hello")
        assert store.find("corpus", "id1") is None  # not visible while being written
    art = store.find("corpus", "id1")
    assert art is not None and (art.path / SUCCESS).exists()
    manifest = json.loads((art.path / "manifest.json").read_text())
    assert manifest["files"]["train/a.txt"]["bytes"] == 5
    assert len(manifest["files"]["train/a.txt"]["sha256"]) == 64


def test_atomic_build_failure_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.building("corpus", "id2", {}) as out:
            (out / "partial.parquet").write_text("half")
            raise RuntimeError("stage crashed")
    assert store.find("corpus", "id2") is None
    assert not store.path("corpus", "id2").exists()
    assert list((tmp_path / "artifacts" / "corpus").iterdir()) == []  # temp dir removed too


def make_plan(cfg, store, ids, **kw):
    from pipeline.plan import make_plan as real

    return real(cfg, store, ids, **kw)


def test_plan_ids_chain_and_cache(tmp_path):
    store = ArtifactStore(tmp_path)
    cfg = PRESETS["debug"]()
    plan = make_plan(cfg, store, {"raw": "r1", "task": "t1"})
    assert plan[0].spec.name == "corpus" and not plan[0].cached
    other = make_plan(cfg, store, {"raw": "r2", "task": "t1"})
    # a different corpus changes every downstream id
    assert all(a.artifact_id != b.artifact_id for a, b in zip(plan, other))
    with store.building("corpus", plan[0].artifact_id, {}):
        pass
    again = make_plan(cfg, store, {"raw": "r1", "task": "t1"})
    assert again[0].cached and again[0].artifact_id == plan[0].artifact_id
    forced = make_plan(cfg, store, {"raw": "r1", "task": "t1"}, force=("corpus",))
    assert not forced[0].cached


def test_plan_only_and_until(tmp_path):
    store = ArtifactStore(tmp_path)
    cfg = PRESETS["debug"]()
    until = make_plan(cfg, store, {"raw": "r1", "task": "t1"}, until="vocab")
    assert [s.spec.name for s in until] == ["corpus", "vocab"] and all(s.selected for s in until)
    only = make_plan(cfg, store, {"raw": "r1", "task": "t1"}, only="vocab")
    assert [(s.spec.name, s.selected) for s in only] == [("corpus", False), ("vocab", True)]
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        make_plan(cfg, store, {"raw": "r1"}, until="nope")


def test_how_fields_stay_out_of_ids_what_fields_do_not(tmp_path):
    import dataclasses

    store, cfg = ArtifactStore(tmp_path), PRESETS["debug"]()
    ids = lambda c: {s.spec.name: s.artifact_id for s in make_plan(c, store, {"raw": "r1", "task": "t1"})}  # noqa: E731
    base = ids(cfg)
    how = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, log_interval=7, max_failures=0,
                                                                cpus_per_worker=3, placement_strategy="SPREAD"),
                              tokenize=dataclasses.replace(cfg.tokenize, num_workers=5),
                              finetune=dataclasses.replace(cfg.finetune, max_concurrent_trials=1))
    assert ids(how) == base
    what = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, lr=1e-4))
    changed = ids(what)
    assert changed["tokenize"] == base["tokenize"]
    assert changed["pretrain"] != base["pretrain"] and changed["finetune"] != base["finetune"]


def test_stage_table_is_explicit():
    assert [s.name for s in STAGES] == ["corpus", "vocab", "tokenize", "pretrain", "finetune"]
    assert all(callable(s.run) and s.version for s in STAGES)


# ----------------------------------------------------------------------------------------------- faults

def test_finalisation_keeps_a_finished_artifact_unless_forced(tmp_path):
    """A finished artifact is never deleted in place: one that appeared meanwhile wins; --force swaps it."""
    store = ArtifactStore(tmp_path)
    with store.building("corpus", "same", {}) as out:
        (out / "a.txt").write_text("theirs")
    with store.building("corpus", "same", {}) as out:
        (out / "a.txt").write_text("ours")
    assert (store.path("corpus", "same") / "a.txt").read_text() == "theirs"
    with store.building("corpus", "same", {}, replace=True) as out:
        (out / "a.txt").write_text("forced")
    assert (store.path("corpus", "same") / "a.txt").read_text() == "forced"
    assert [p.name for p in (tmp_path / "artifacts" / "corpus").iterdir()] == ["same"] and not store.leftovers()


def test_leftovers_name_their_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    for name in (".tmp-news-test-0a1b2c3d", ".old-abc123-ffffffff", "abc123"):
        (tmp_path / "artifacts" / "corpus" / name).mkdir(parents=True)
    assert [(s, i, p.name) for s, i, p in store.leftovers()] == [
        ("corpus", "news-test", ".tmp-news-test-0a1b2c3d"), ("corpus", "abc123", ".old-abc123-ffffffff")]


def test_verify_sizes_always_digests_on_demand(tmp_path):
    from core.artifacts import verify
    from core.errors import StageInputError

    store = ArtifactStore(tmp_path)
    contents = {f"train/{k}.parquet": bytes(range(256)) * (4 + k) for k in range(5)}  # hashed by several threads
    with store.building("corpus", "c1", {}) as out:
        (out / "train").mkdir()
        for rel, data in contents.items():
            (out / rel).write_bytes(data)
    art = store.find("corpus", "c1")
    assert {rel: entry["sha256"] for rel, entry in art.manifest["files"].items()} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in contents.items()}
    verify(art, digests=True)
    shard = art.path / "train" / "0.parquet"
    shard.write_bytes(bytes(range(256)) * 2)  # truncated
    with pytest.raises(StageInputError, match=rf"{shard} has 512 bytes, its manifest says 1024 .*--force corpus"):
        verify(art)
    shard.write_bytes(bytes(range(1, 256)) + b"\0" + bytes(range(256)) * 3)  # same size, other bytes
    verify(art)
    with pytest.raises(StageInputError, match=rf"{shard} does not match its manifest's sha256.*--force corpus"):
        verify(art, digests=True)
    shard.unlink()
    with pytest.raises(StageInputError, match=rf"{shard} is missing"):
        verify(art)


def test_a_full_disk_is_recognised_and_named(tmp_path):
    import errno

    from core.artifacts import is_disk_full, watching_writes

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("a worker failed") from e
    except RuntimeError as e:
        assert is_disk_full(e)
    assert not is_disk_full(OSError(errno.ENOENT, "missing"))
    assert is_disk_full(OSError("[Errno 28] No space left on device"))  # pyarrow's, errno only in the text
    with watching_writes(tmp_path) as last_written:
        (tmp_path / "sample.txt").write_text("x")
        (tmp_path / "sample.txt").read_text()  # reading is not writing
        open("/dev/null", "w").close()  # outside the root
        assert last_written() == str(tmp_path / "sample.txt")

    # stages built side by side in threads each name their own file
    import threading

    seen, wrote = {}, threading.Barrier(2)

    def stage(name: str) -> None:
        with watching_writes(tmp_path) as last:
            (tmp_path / name).write_text("x")
            wrote.wait()  # both have written before either looks
            seen[name] = last()

    threads = [threading.Thread(target=stage, args=(n,)) for n in ("a.txt", "b.txt")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {n: str(tmp_path / n) for n in ("a.txt", "b.txt")}
