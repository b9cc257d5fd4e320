"""The entry point against a real `mlflow server`: lineage runs, caching, and clear errors."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pipeline_main

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SMALL = ["--set", "vocab.vocab_size=600", "--set", "model.vocab_size=700",
         "--set", "tokenize.max_seq_len=64", "--until", "tokenize"]


def pipeline(args: list[str], env_extra: dict[str, str] | None = None, timeout: int = 900):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_corpus(news_subset) -> Path:
    """The first 300 real news articles, as a user's JSONL corpus."""
    return news_subset(300)


# Runs the entry point in this process and reports which heavy packages it loaded: the pipeline's core and
# the data stages (corpus, vocab, tokenize) must not import torch, DeepSpeed or the model library's modules
# (its `deberta.config`, the [model] section, is plain Python).
PROBE = ("import sys; from pipeline.run import main; rc = main(sys.argv[1:]); "
         "print('LOADED', sorted({m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'deberta')} "
         "- {'deberta', 'deberta.config'})); sys.exit(rc)")


@pytest.fixture(scope="module")
def two_runs(small_corpus, mlflow_server, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wd")
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    args = ["--corpus", str(small_corpus), "--workdir", str(workdir), *SMALL]
    first = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = pipeline(args, env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return workdir, first, second


def _runs(uri: str, parent_id: str):
    """The child runs of one invocation's parent run (other tests share the server)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("deberta-pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                              order_by=["attributes.start_time ASC"], max_results=500)
    return client, runs


def _parent_id(stdout: str) -> str:
    match = re.search(r"\(parent run ([0-9a-f]+)\)", stdout)
    assert match, stdout[-2000:]
    return match.group(1)


def test_lineage_runs_and_tags(two_runs, mlflow_server):
    workdir, first, _ = two_runs
    client, children = _runs(mlflow_server, _parent_id(first.stdout))
    assert client.get_run(_parent_id(first.stdout)).info.status == "FINISHED"
    stages = [r.data.tags["pipeline.stage"] for r in children]
    assert stages[:2] == ["corpus", "vocab"]
    by_stage = {r.data.tags["pipeline.stage"]: r for r in children}
    corpus_id = by_stage["corpus"].data.tags["pipeline.artifact_id"]
    assert (workdir / "artifacts" / "corpus" / corpus_id / "_SUCCESS").exists()
    # the vocab run names the corpus artifact it read, as a tag and as a logged dataset input
    vocab = client.get_run(by_stage["vocab"].info.run_id)
    assert vocab.data.tags["pipeline.input.corpus"] == corpus_id
    assert any(d.dataset.name == f"corpus:{corpus_id}" for d in vocab.inputs.dataset_inputs)
    assert vocab.data.params["vocab.vocab_size"] == "600"
    manifest = json.loads((workdir / "artifacts" / "vocab" / vocab.data.tags["pipeline.artifact_id"]
                           / "manifest.json").read_text())
    assert manifest["inputs"]["corpus"] == corpus_id and "spm.model" in manifest["files"]
    assert all(r.info.status == "FINISHED" for r in children)


def test_core_and_data_stages_never_import_torch(two_runs):
    _, first, _ = two_runs
    assert "running -> " in first.stdout and "LOADED []" in first.stdout, first.stdout[-2000:]


def plan_of(args: list[str]) -> dict[str, tuple[str, str]]:
    """stage -> (artifact id, state) from `--dry-run`."""
    res = pipeline_main([*args, "--dry-run"])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = re.findall(r"^  (\w+)\s+([0-9a-f]{16})  (.+)$", res.stdout, re.M)
    return {stage: (art, state) for stage, art, state in rows}


def test_cache_key_what_and_how(two_runs, small_corpus, tmp_path):
    """A *how* field keeps the artifact, a *what* field or an in-place edit of a corpus file re-runs."""
    workdir, _, _ = two_runs
    base = ["--corpus", str(small_corpus), "--workdir", str(workdir), *SMALL]
    assert {s for s, (_, state) in plan_of(base).items()} == {"corpus", "vocab", "tokenize"}
    assert all(state == "cached (skip)" for _, state in plan_of(base).values())
    how = plan_of([*base, "--set", "tokenize.num_workers=1"])
    assert all(state == "cached (skip)" for _, state in how.values()), how
    what = plan_of([*base, "--set", "tokenize.batch_size=32"])
    assert what["vocab"][1] == "cached (skip)" and what["tokenize"][1] == "run", what
    # A typo fixed in place: same size, new content -> the corpus and everything after it run again.
    edited = tmp_path / "corpus.jsonl"
    text = small_corpus.read_text()
    edited.write_text(text)
    before = plan_of(["--corpus", str(edited), "--workdir", str(workdir), *SMALL])
    edited.write_text(text.replace("the", "teh", 1))
    after = plan_of(["--corpus", str(edited), "--workdir", str(workdir), *SMALL])
    assert edited.stat().st_size == len(text.encode())
    assert after["corpus"][0] != before["corpus"][0] and after["corpus"][1] == "run"


def test_builtin_corpus_id_does_not_depend_on_the_workdir(tmp_path):
    one = plan_of(["--workdir", str(tmp_path / "a"), "--until", "corpus"])
    two = plan_of(["--workdir", str(tmp_path / "b" / "deeper"), "--until", "corpus"])
    assert one["corpus"][0] == two["corpus"][0]


def test_second_invocation_is_a_no_op(two_runs, mlflow_server):
    workdir, first, second = two_runs
    assert "cached" in second.stdout and "running ->" not in second.stdout
    client, cached = _runs(mlflow_server, _parent_id(second.stdout))
    assert cached and all(r.data.tags["pipeline.status"] == "cached" for r in cached)
    for stage_dir in (workdir / "artifacts").iterdir():
        assert len([p for p in stage_dir.iterdir()]) == 1, f"{stage_dir.name} was rebuilt"
    assert "=== summary ===" in second.stdout and "mlflow" in second.stdout.lower()


@pytest.mark.parametrize("args, fragment", [
    (["--preset", "deberta-2b"], "unknown preset 'deberta-2b'"),
    (["--set", "pretrain.max_steps=ten"], "pretrain.max_steps=ten: expected int"),
    (["--set", "pretrain.bogus=1"], "unknown key 'bogus' in [pretrain]"),
    (["--corpus", "/nonexistent/corpus/*.txt"], "/nonexistent/corpus"),
    (["--workdir", "/proc/not-writable"], "cannot be created: /proc is on the kernel's proc file system"),
    # bounds the stages enforce, refused before the first stage
    (["--set", "tokenize.max_seq_len=2"], "tokenize.max_seq_len=2: needs room for [CLS]"),
    (["--set", "finetune.max_seq_len=4096"], "finetune.max_seq_len=4096 exceeds model.max_position_embeddings"),
    (["--set", "vocab.sample_documents=0"], "vocab.sample_documents=0: must be >= 1"),
    (["--set", "pretrain.placement_strategy=ANY"], "pretrain.placement_strategy='ANY'"),
])
def test_bad_input_one_clear_message(args, fragment, tmp_path):
    workdir = ["--workdir", str(tmp_path / "wd")] if "--workdir" not in args else []
    res = pipeline_main([*args, *workdir])  # a real run, not --dry-run: it must stop before any stage
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr
    assert not (tmp_path / "wd" / "artifacts").exists()  # nothing half-written


# ----------------------------------------------------------------------------------------------- finetune.init

@pytest.fixture(scope="module")
def hf_deberta(small_corpus, tmp_path_factory) -> Path:
    """A whole HF DebertaV2 directory as someone else's checkpoint: a debug-size MLM (random weights) with a real
    600-piece vocabulary trained on the small corpus."""
    from deberta import hf
    from deberta.config import debug, padded_vocab_size
    from deberta.model import DebertaForMaskedLM
    from core.config import VocabConfig
    from core.tokenizer import MODEL_FILE, SPECIAL_FILE, Tokenizer
    from stages.vocab import train_model

    root = tmp_path_factory.mktemp("hf")
    docs = [json.loads(line)["text"] for line in small_corpus.read_text().splitlines()]
    (root / "sample.txt").write_text("\n".join(p.strip() for d in docs for p in d.splitlines() if p.strip()) + "\n")
    (root / "vocab").mkdir()
    train_model(VocabConfig(vocab_size=600), root / "sample.txt", root / "vocab", num_threads=1)
    tok = Tokenizer.load(root / "vocab" / MODEL_FILE)
    (root / "vocab" / SPECIAL_FILE).write_text(json.dumps(tok.special_ids))
    mlm = DebertaForMaskedLM(debug(vocab_size=padded_vocab_size(len(tok)))).eval()
    return hf.save_pretrained(mlm, root / "deberta", vocab_dir=root / "vocab")


def _not_deberta(hf_deberta: Path, tmp: Path) -> str:
    (tmp / "bert").mkdir()
    (tmp / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 30522}))
    return str(tmp / "bert")


def _tokenizer_too_long(hf_deberta: Path, tmp: Path) -> str:
    import shutil

    shutil.copytree(hf_deberta, tmp / "mismatch")
    config = json.loads((tmp / "mismatch" / "config.json").read_text())
    (tmp / "mismatch" / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    return str(tmp / "mismatch")


@pytest.mark.parametrize("make, fragment", [
    (_not_deberta, "not a DeBERTa-v2/v3 model (config.json says model_type='bert')"),
    (_tokenizer_too_long, "the tokenizer has 601 ids but config.vocab_size=300"),
    (lambda _, tmp: "models:/deberta-debug-pretrained/1", "there is no registry at"),
], ids=["not-deberta", "tokenizer-vs-vocab", "unknown-uri"])
def test_bad_finetune_init_is_one_message_before_ray(make, fragment, hf_deberta, tmp_path):
    """A real run (not --dry-run) stops at resolving finetune.init: exit 2, one line, no plan, nothing built."""
    init = make(hf_deberta, tmp_path)
    res = pipeline_main(["--set", f"finetune.init={init}", "--workdir", str(tmp_path / "wd")], {"MLFLOW_TRACKING_URI": ""})
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert lines[0].startswith(f"error: finetune.init={init}: ") and fragment in lines[0], lines
    assert "plan:" not in res.stdout and not (tmp_path / "wd" / "artifacts").exists()


def test_pretrained_is_short_for_finetune_init(hf_deberta, tmp_path):
    """`--pretrained DIR` sets finetune.init to the directory and the [model] section to its config.json (read here
    with json), and plans what `--set finetune.init=DIR` plans: the finetune stage alone (init is a *how* field: the
    checkpoint's digest is the input). `--pretrained` runs for real in tests/integration/test_finetune.py (a
    directory) and below (a registry version)."""
    res = pipeline_main(["--pretrained", str(hf_deberta), "--workdir", str(tmp_path / "wd"), "--dry-run"])
    assert res.returncode == 0, res.stderr[-2000:]
    resolved = json.loads(res.stdout[res.stdout.index("{"):res.stdout.index("\n}\n") + 2])
    config = json.loads((hf_deberta / "config.json").read_text())
    assert resolved["finetune"]["init"] == str(hf_deberta)
    shape = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings")
    assert {k: resolved["model"][k] for k in shape} == {k: config[k] for k in shape}
    rows = re.findall(r"^  (\w+)\s+([0-9a-f]{16})  (.+)$", res.stdout, re.M)
    plan = plan_of(["--set", f"finetune.init={hf_deberta}", "--workdir", str(tmp_path / "wd")])
    assert {stage: (art, state) for stage, art, state in rows} == plan and list(plan) == ["finetune"]
    assert plan["finetune"][1] == "run"


# ----------------------------------------------------------------------------------------------- the plan on paper

def test_dry_run_days_are_the_papers_schedule_at_the_stated_throughput(tmp_path):
    """`--preset deberta-1.5b --dry-run`: the printed compute and duration, recomputed here from the paper and the
    data sheet instead of read back. DeBERTa Table 8: 1M steps of 2,048 x 512 tokens; 48 layers of width 1,536, a
    128,100-row vocabulary, relative positions over 2 x 256 rows. Training FLOPs per token = 6 N for the matmul
    weights (N = the backbone less its word embedding, which is a lookup) + 3 x 48 x (4 T H + 4 R H) for the
    content and disentangled attention scores (DeBERTa §3.1; T = 512, R = 512), within 5% (the LM head on the
    15% of targets adds ~2%, the EMD running the last layer only at the targets saves ~1%). The H100's dense bf16
    peak is 989 TFLOP/s (NVIDIA's data sheet); the utilisation is the one the plan says it measured, read from it."""
    res = pipeline_main(["--preset", "deberta-1.5b", "--workdir", str(tmp_path / "wd"), "--dry-run"])
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    workers = int(re.search(r"= (\d+) workers, ZeRO-", out).group(1))
    backbone = int(re.search(r"backbone ([\d,]+)\)", out).group(1).replace(",", ""))
    gflop = float(re.search(r"compute: ([\d.]+) GFLOP/token", out).group(1))
    mfu, peak, step_s, steps, days = re.search(
        r"at ([\d.]+)% MFU \(measured: [^)]+\) of (\d+) TFLOP/s bf16 per H100: ([\d.]+) s/step, ([\d,]+) steps = "
        r"([\d.]+) days", out).groups()
    layers, hidden, vocab, seq, rows = 48, 1536, 128_100, 512, 2 * 256
    flops = 6 * (backbone - vocab * hidden) + 3 * layers * (4 * seq * hidden + 4 * rows * hidden)
    assert workers == 128 and int(peak) == 989 and int(steps.replace(",", "")) == 1_000_000
    assert gflop * 1e9 == pytest.approx(flops, rel=0.05), (gflop, flops / 1e9)
    want_step_s = 2048 * seq * flops / (workers * 989e12 * float(mfu) / 100)
    assert float(step_s) == pytest.approx(want_step_s, rel=0.05), (step_s, want_step_s)
    assert float(days) == pytest.approx(1_000_000 * want_step_s / 86_400, rel=0.05), (days, want_step_s)


# ----------------------------------------------------------------------------------------------- registry versions

TINY_FINETUNE = [a for s in ("finetune.dropout=0.0", "finetune.warmup_steps=1", "finetune.lr=1e-3",
                             "finetune.batch_size=16", "finetune.epochs=1", "finetune.max_seq_len=64",
                             "finetune.max_train_examples=64", "finetune.max_concurrent_trials=1", "ray.num_cpus=2",
                             "ray.dashboard=false")
                 for a in ("--set", s)]


def _summary(stdout: str) -> dict[str, tuple[str, str]]:
    """stage -> (artifact id, ran or cached) from the run's `=== summary ===`."""
    tail = stdout.split("=== summary ===")[-1]
    return {s: (art, how) for s, art, how in re.findall(r"^  (\w+)\s+([0-9a-f]{16})  \((\w+)\)", tail, re.M)}


def test_pretrained_version_is_the_runs_artifacts_and_fills_masks(continued_mlm, mlflow_server, monkeypatch):
    """The registry version the pretrain stage registers, from the entry point (the session's `continued_mlm`: a run
    from a corpus file to a pretrained model, continuing a released checkpoint): its lineage tags are the artifact
    ids the run planned and built (the directories on disk; where it started from, the `init.*` tags, is
    test_continue.py's), and `mlflow.pyfunc` answers fill-mask with what the artifact's own model computes
    (tests/integration/mlflow_serve.py: fill_mask_reference)."""
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from deberta import checkpoint, hf
    from deberta.model import DebertaForMaskedLM
    from core.tokenizer import Tokenizer
    from tests.integration.mlflow_serve import fill_mask_reference

    res, workdir, _, version = continued_mlm
    stages = _summary(res.stdout)
    assert {s: how for s, (_, how) in stages.items()} == {s: "ran" for s in ("corpus", "vocab", "tokenize",
                                                                              "pretrain")}, stages
    ids = {s: art for s, (art, _) in stages.items()}
    for stage, art in ids.items():
        assert (workdir / "artifacts" / stage / art / "_SUCCESS").is_file(), stage
    client = MlflowClient(mlflow_server)
    mv = client.get_model_version("deberta-debug-pretrained", version)
    assert {k: v for k, v in mv.tags.items() if not k.startswith("init.")} == {**ids, "objective": "mlm"}
    assert client.get_run(mv.run_id).data.tags["pipeline.artifact_id"] == ids["pretrain"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    masked = ["The president said on [MASK] that he would resign.", "Shares of the [MASK] fell sharply."]
    filled = mlflow.pyfunc.load_model(f"models:/deberta-debug-pretrained/{version}").predict(
        pd.DataFrame({"text": masked}))
    art = workdir / "artifacts" / "pretrain" / ids["pretrain"]
    model = DebertaForMaskedLM(checkpoint.load_config(art / "model"))
    assert checkpoint.load_into(model, art / "model") == []
    vocab = workdir / "artifacts" / "vocab" / ids["vocab"]
    best, probs = fill_mask_reference(model, hf.build_tokenizer(vocab, 64), masked)
    assert [t.strip() for t in filled["token"]] == [Tokenizer.load(vocab).decode([i]).strip() for i in best]
    assert filled["score"].tolist() == pytest.approx(probs, abs=1e-5)


SUITE = ("lee-sts", "wnut16-ner", "rotten-tomatoes-choice")
"""Three built-in tasks of three kinds (sequence, token, choice), the ones with the fewest dev examples."""


def _suite_summary(stdout: str) -> dict[str, tuple[str, str]]:
    """`finetune:<task>` -> (artifact id, ran or cached) from the run's `=== summary ===`."""
    tail = stdout.split("=== summary ===")[-1]
    return {t: (art, how) for t, art, how in re.findall(r"^  finetune:(\S+)\s+([0-9a-f]{16})  \((\w+)\)", tail, re.M)}


def _tiny_task(root: Path) -> Path:
    """A sentence task directory of 16 train and 2 dev reviews (its own: the train texts name it)."""
    root.mkdir(parents=True)
    (root / "train.tsv").write_text("sentence1\tlabel\n" + "".join(f"{root.name} {i} was {w}\t{w}\n" for i, w in
                                                                   enumerate(["good", "bad"] * 8)))
    (root / "dev.tsv").write_text("sentence1\tlabel\na good film\tgood\na bad film\tbad\n")
    return root


def test_a_suite_of_tasks_from_the_pretrained_registry_version(continued_mlm, mlflow_server, tmp_path):
    """`python -m pipeline.run --pretrained models:/deberta-debug-pretrained/N --task A,B,C` in a fresh workdir: the
    version's export is downloaded byte for byte (the pretrain artifact's hf/) and each task fine-tuned on the
    version's architecture, registered as its own model naming the version it started from, and the run's table
    (DeBERTa Table 2's row) logged on its top-level run with each champion's seed mean and Avg. Then the same tasks
    plus two: the three are cached, the fourth runs, and one failing at stage time leaves the others registered
    (exit 1, the parent run FAILED)."""
    import hashlib

    import mlflow

    from bench.served import served_metric
    from deberta import checkpoint
    from stages.finetune.tasks import resolve_task

    _, _, arts, version = continued_mlm
    uri, wd = f"models:/deberta-debug-pretrained/{version}", tmp_path / "wd"
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    args = ["--pretrained", uri, "--workdir", str(wd), *TINY_FINETUNE]
    res = pipeline([*args, "--task", ",".join(SUITE)], env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = _suite_summary(res.stdout)
    assert ran == {t: (ran[t][0], "ran") for t in SUITE}, res.stdout[-2000:]
    pretrained = arts["pretrain"]
    finetuned = wd / "artifacts" / "finetune" / ran["lee-sts"][0] / "model"
    assert checkpoint.load_config(finetuned) == checkpoint.load_config(pretrained / "model")

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}

    (local,) = (wd / "registry" / "deberta-debug-pretrained").glob(f"{version}-*")  # VERSION-<its logged model>
    assert digests(local) == digests(pretrained / "hf")

    client, children = _runs(mlflow_server, _parent_id(res.stdout))
    mlflow.set_tracking_uri(mlflow_server)
    stage_runs = {r.data.tags["pipeline.artifact_id"]: r for r in children
                  if r.data.tags["pipeline.stage"] == "finetune"}
    for task, (art, _) in ran.items():  # each its own champion, registered from its own sweep and stage run
        inputs = client.get_run(stage_runs[art].info.run_id).inputs.dataset_inputs  # the task and the checkpoint
        assert [json.loads(d.dataset.source) for d in inputs if d.dataset.source_type == "mlflow_registry"] == \
            [{"uri": uri}], [(d.dataset.name, d.dataset.source_type) for d in inputs]
        mv = client.get_model_version_by_alias(f"deberta-debug-{task}", "champion")
        assert mv.tags["init"] == uri and mv.tags["sweep"] == art and mv.run_id == stage_runs[art].info.run_id
        # an external checkpoint's pretraining corpus is not this pipeline's to read: its dev contamination is unknown
        assert mv.tags["dev_contamination"] == "unknown", mv.tags
        # served is measured, for every task of the suite: the version's own answers on the dev set, scored here
        # (labels, entities and choices exactly, up to the tag's 6 decimals; a regression's scores to float rounding)
        task_ref = resolve_task(task)
        served = served_metric(mlflow.pyfunc.load_model(f"models:/deberta-debug-{task}/{mv.version}"), task_ref)
        tolerance = 1e-4 if task_ref.problem == "regression" else 1e-6
        assert served == pytest.approx(float(mv.tags[f"dev_{task_ref.metric}"]), abs=tolerance), task
    assert res.stdout.count("; dev contamination: unknown") == len(SUITE), res.stdout[-3000:]
    # the sweeps share the cluster: the tasks' stage runs (each its sweep and export) overlap in time; one after
    # another they would not. (Their one-trial sweeps' trials last about 2 s: too short to overlap reliably.)
    spans = {task: (stage_runs[art].info.start_time, stage_runs[art].info.end_time) for task, (art, _) in ran.items()}
    assert any(spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
               for a, b in itertools.combinations(SUITE, 2)), spans
    parent = _parent_id(res.stdout)
    table = json.loads(Path(client.download_artifacts(parent, "suite.json", str(tmp_path))).read_text())
    rows = {r["task"]: r for r in table["rows"]}
    assert list(rows) == list(SUITE)
    assert {r["kind"] for r in rows.values()} == {"regression", "token", "choice"}
    for task, (art, _) in ran.items():
        champion = json.loads((wd / "artifacts" / "finetune" / art / "champion.json").read_text())
        assert rows[task]["champion"] == pytest.approx(champion["seed_mean"]) and rows[task]["status"] == "ran"
    assert table["avg"] == pytest.approx(sum(r["champion"] for r in rows.values()) / 3)
    assert {"suite.csv", "suite.png"} <= {a.path for a in client.list_artifacts(parent)}
    assert client.get_run(parent).data.metrics["suite.avg"] == pytest.approx(table["avg"])

    # a fourth task and one that fails at stage time, reading and checking fine before Ray starts (its sweep's
    # directory in Ray storage is taken by a file): the dry run plans only those two, the run builds the fourth
    tiny, blocked = _tiny_task(tmp_path / "tiny"), _tiny_task(tmp_path / "blocked")
    more = [*args, "--task", ",".join([*SUITE, str(blocked), str(tiny)])]  # the failure first: the rest still runs
    dry = pipeline_main([*more, "--dry-run"], env)
    plan = dict(re.findall(r"^  finetune:(\S+)\s+([0-9a-f]{16})  run$", dry.stdout, re.M))
    assert set(plan) == {"tiny", "blocked"} and "5 tasks (" in dry.stdout, dry.stdout[-2000:]
    (wd / "ray_results").mkdir(exist_ok=True)
    (wd / "ray_results" / f"finetune-{plan['blocked']}").write_text("not a sweep directory")
    again = pipeline(more, env)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "error: stage finetune:blocked failed" in again.stderr
    after = _suite_summary(again.stdout)
    assert after == {**{t: (ran[t][0], "cached") for t in SUITE},
                     "tiny": (plan["tiny"], "ran")}, again.stdout[-2000:]
    assert client.get_model_version_by_alias("deberta-debug-tiny", "champion").tags["sweep"] == plan["tiny"]
    parent = _parent_id(again.stdout)
    assert client.get_run(parent).info.status == "FAILED"
    (tmp_path / "again").mkdir()
    rows = json.loads(Path(client.download_artifacts(parent, "suite.json", str(tmp_path / "again"))).read_text())
    assert [r["status"].split(":")[0] for r in rows["rows"]] == ["cached"] * 3 + ["failed", "ran"]
