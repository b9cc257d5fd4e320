"""The command line at plan time: nothing typed is dropped, every mistake is one `error:` line before Ray starts (and
before the resolved config), a dry run writes nothing and plans for the hardware configured. Every case is the
entry point's own `main` in this process, stopping before Ray: seconds in all."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import pipeline_main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpora(news_subset, tmp_path_factory) -> dict[str, Path]:
    """Small real corpora as a user would point --corpus at them."""
    root = tmp_path_factory.mktemp("corpora")
    text = news_subset(60).read_text().splitlines(keepends=True)
    for name, lines in (("a", text[:30]), ("b", text[30:])):
        (root / name).mkdir()
        (root / name / f"{name}.jsonl").write_text("".join(lines))
    (root / "md").mkdir()
    (root / "md" / "readme.md").write_text("# notes\n")
    (root / "mixed").mkdir()
    (root / "mixed" / "readme.md").write_text("# notes\n")
    (root / "mixed" / "a.jsonl").write_text("".join(text[:30]))
    (root / "empty").mkdir()
    (root / "one.jsonl").write_text(json.dumps({"text": "One short document, far too small to pretrain on."}) + "\n")
    (root / "short.jsonl").write_text("".join(json.dumps({"text": f"document {i} is short."}) + "\n"
                                              for i in range(40)))
    with gzip.open(root / "content.jsonl.gz", "wt") as f:  # the text under another field, as many dumps hold it
        f.write("\n" + "".join(json.dumps({"id": i, "content": line}) + "\n" for i, line in enumerate(text[:2])))
    pq.write_table(pa.table({"id": [0, 1], "body": text[:2]}), root / "body.parquet")
    return {p.name.split(".")[0]: p for p in root.iterdir()}


def _config(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):stdout.index("\n}\n") + 2])


def _plan(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\w+)\s+([0-9a-f]{16})  ", stdout, re.M))


def test_every_corpus_flag_is_kept_and_listed(corpora, tmp_path):
    """--corpus given twice keeps both (named: both sources; unnamed: both paths, the same corpus as one flag with
    two values), and the dry run lists every source with its files and bytes."""
    a, b = corpora["a"], corpora["b"]
    wd = ["--workdir", str(tmp_path / "wd"), "--until", "corpus", "--dry-run"]
    named = pipeline_main(["--corpus", f"news={a}:weight=0.5", "--corpus", f"docs={b}:weight=0.5", *wd])
    assert named.returncode == 0, named.stderr
    assert _config(named.stdout)["corpus"]["sources"] == [f"news={a}:weight=0.5", f"docs={b}:weight=0.5"]
    size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
    assert re.search(rf"^  news +news={a}:weight=0.5: 1 file\(s\), {size(a) / 1e6:,.1f} MB$", named.stdout, re.M)
    assert re.search(rf"^  docs +docs={b}:weight=0.5: 1 file\(s\), {size(b) / 1e6:,.1f} MB$", named.stdout, re.M)
    twice = pipeline_main(["--corpus", str(a), "--corpus", str(b), *wd])
    once = pipeline_main(["--corpus", str(a), str(b), *wd])
    assert twice.returncode == once.returncode == 0, twice.stderr + once.stderr
    assert _plan(twice.stdout) == _plan(once.stdout)
    assert re.search(r"^corpus: 2 file\(s\), .* in 1 source\(s\)$", twice.stdout, re.M), twice.stdout[-1500:]


def _without_aws(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path), **{k: "" for k in os.environ if k.startswith("AWS_") and k != "AWS_CA_BUNDLE"}}


MISTAKES = [
    (["--corpus", "{md}"], "none of its 1 file(s) is of a type the corpus stage reads (readme.md)"),
    (["--corpus", "{one}"], "the corpus holds 1 document(s); its 0.05 validation split"),
    (["--corpus", "{one}", "--until", "vocab"], "vocab.vocab_size=4000 pieces cannot be found in a corpus of 62 bytes"),
    (["--force", "nope"], "--force nope: unknown stage"),
    (["--corpus", "{a}", "--only", "pretrain"], "--only pretrain needs corpus, vocab, tokenize built first"),
    (["--until", "corpus", "--force", "pretrain"], "--force pretrain: this run does not build pretrain"),
    (["--only", "vocab", "--force", "corpus"], "use --until vocab --force corpus"),
    (["--task", "lee-sts", "--set", "finetune.task=wnut16-ner"], "--task lee-sts and --set finetune.task=wnut16-ner"),
    (["--task", "lee-sts", "--task", "wnut16-ner"], "argument --task: given twice (lee-sts and wnut16-ner)"),
    (["--corpus", "{a}", "--until", "pretrain", "--task", "lee-sts"], "--task lee-sts: this run stops before"),
    (["--corpus", "{empty}"], "corpus directory '{empty}' is empty"),
    (["--workdir", "/proc/x"], "workdir /proc/x cannot be created: /proc is on the kernel's proc file system"),
    (["--corpus", "s3://no-such-bucket-pipeline/x"], "no AWS credentials are set"),
    (["--preset", "deberta-base", "--corpus", "{a}", "--until", "pretrain"],
     "pretrain.use_gpu=true asks for 32 GPUs but the Ray cluster has 0"),
    (["--corpus", "{a}", "--until", "pretrain", "--set", "pretrain.probes=no-such-task"],
     "task 'no-such-task' is neither a built-in"),
    (["--corpus", "file://{content}"], "content.jsonl.gz: its first record has no field 'text' (fields: id, content); "
                                       "set corpus.jsonl_field to the field holding the text, e.g. --set "
                                       "corpus.jsonl_field=content"),
    (["--corpus", "{body}"], "body.parquet has no column 'text' (columns: id, body); set corpus.parquet_column"),
    (["--corpus", "{a}", "--until", "corpus", "--set", "corpus.decontaminate=rotten-tomatoes,no-such-task"],
     "corpus.decontaminate='no-such-task': neither a built-in task"),
    ]
NAMES = ["readme-only", "one-document", "vocab-too-large", "force-unknown", "only-on-empty", "force-outside-until",
         "force-outside-only", "task-twice", "task-flag-twice", "task-not-planned", "empty-dir", "proc-workdir",
         "s3-no-credentials", "gpu-preset-on-cpu", "probe-not-a-task", "jsonl-field-elsewhere",
         "parquet-column-elsewhere", "decontaminate-not-a-task"]
ONCE = {"s3-no-credentials"}
"""Cases run as a dry run only: the same listing refuses them in both, and the store's retries take seconds."""


@pytest.mark.parametrize("args, fragment, dry", [
    pytest.param(args, fragment, dry, id=f"{'dry-run' if dry else 'real-run'}-{name}")
    for (args, fragment), name in zip(MISTAKES, NAMES) for dry in (True, False) if dry or name not in ONCE])
def test_a_mistake_is_one_error_line_first(args, fragment, dry, corpora, tmp_path):
    """Refused with exit 2 and one `error:` line, before the resolved config is printed and before Ray starts, by a
    dry run and by a real run alike (the GPU preset on a machine without GPUs: by the real run; its dry run says
    it). Every run sees no GPU and joins no cluster (CUDA_VISIBLE_DEVICES and RAY_ADDRESS empty), whatever machine
    the suite runs on: a local Ray here would have 0 GPUs."""
    argv = [a.format(**{k: str(v) for k, v in corpora.items()}) for a in args]
    workdir = [] if "--workdir" in argv else ["--workdir", str(tmp_path / "wd")]
    env = {**_without_aws(tmp_path), "CUDA_VISIBLE_DEVICES": "", "RAY_ADDRESS": ""}
    res = pipeline_main([*argv, *workdir, *(["--dry-run"] if dry else [])], env)
    if dry and "GPUs" in fragment:
        assert res.returncode == 0 and f"it lacks what this plan needs: {fragment}" in res.stdout, res.stderr
        return
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("error: ") and fragment.format(empty=corpora["empty"]) in lines[0], lines[0]
    assert res.stdout == "", res.stdout[-500:]  # the one line first and alone: no resolved config before it
    assert not (tmp_path / "wd").exists()
    if "s3://" in " ".join(argv):  # the store's own words kept whole (the host it could not reach, not cut mid-word)
        assert lines[0].endswith(")") and "(the store said: " in lines[0], lines[0]
        said = lines[0].split("(the store said: ", 1)[1]
        assert said.count("(") + 1 == said.count(")"), said


def test_only_decontamination_changes_the_corpus_id(corpora, tmp_path):
    """The task a run fine-tunes on leaves the corpus artifact alone; naming it in corpus.decontaminate makes another
    corpus (GPT-3's 13-gram rule, Brown et al. 2020, App. C), and another task another one again."""
    base = ["--corpus", str(corpora["a"]), "--workdir", str(tmp_path / "wd"), "--dry-run"]
    plans = [_plan(pipeline_main([*base, *extra]).stdout)["corpus"] for extra in (
        ["--until", "corpus"], ["--task", "wnut16-ner"], ["--task", "wnut16-ner", "--set", "corpus.decontaminate=wnut16-ner"],
        ["--until", "corpus", "--set", "corpus.decontaminate=lee-sts"])]
    assert plans[0] == plans[1] and len(set(plans[1:])) == 3, plans


def test_a_dry_run_writes_nothing(tmp_path):
    """An existing empty workdir stays empty after a dry run of the whole default pipeline (the built-in corpus is
    listed from a temporary copy)."""
    wd = tmp_path / "wd"
    wd.mkdir()
    res = pipeline_main(["--workdir", str(wd), "--dry-run"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert list(wd.iterdir()) == []


def test_skipped_files_are_warned_of(corpora, tmp_path):
    res = pipeline_main(["--corpus", str(corpora["mixed"]), "--workdir", str(tmp_path / "wd"), "--until", "corpus",
                         "--dry-run"])
    assert res.returncode == 0, res.stderr
    assert "warning: corpus " in res.stderr and "1 of 2 files are of an unreadable type" in res.stderr, res.stderr


def test_the_default_dry_run_plans_for_cpus(corpora, tmp_path):
    """The default preset (use_gpu=false) is planned on CPU workers with a CPU step time, never GPUs; its tokens per
    step are the sequences tokenize will write."""
    res = pipeline_main(["--corpus", str(corpora["a"]), "--workdir", str(tmp_path / "wd"), "--until", "pretrain",
                         "--set", "tokenize.max_seq_len=64", "--dry-run"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "pretrain plan: 2 CPU worker(s) x 1 CPU = 2 CPUs" in res.stdout and "H100" not in res.stdout
    assert "16 sequences x 64 tokens (tokenize.max_seq_len) = 1,024 tokens/step" in res.stdout
    assert re.search(r"time: [\d.e+-]+ s/step \((measured|at the)", res.stdout) or "cpu_plan.json missing" in res.stdout


def test_cli_and_docs_name_the_same_presets_flags_and_stages():
    """`--help`, README and docs/configuration.md agree: every preset, every flag, every stage's words."""
    from pipeline.plan import STAGES
    from pipeline.presets import PRESETS
    from pipeline.run import build_parser

    readme, config = (REPO / "README.md").read_text(), (REPO / "docs" / "configuration.md").read_text()
    usage = readme.split("## Command line", 1)[1].split("```")[1]
    for flag in (o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")):
        assert flag == "--help" or flag in usage, f"{flag} missing from README's usage"
    # README writes families with braces: `deberta-v3-{xsmall,small}-continue`
    readme_presets = {f"{head}{part}{tail}" for head, parts, tail in re.findall(r"`([\w.-]*)\{([\w.,]+)\}([\w.-]*)`", readme)
                      for part in parts.split(",")} | set(re.findall(r"`([\w.-]+)`", readme))
    for name in PRESETS:
        assert f"`{name}`" in config, f"preset {name} missing from docs/configuration.md"
        assert name in readme_presets, f"preset {name} missing from README's presets"
    for spec in STAGES:
        assert spec.help in config, f"stage {spec.name}'s words ({spec.help}) missing from docs/configuration.md"


def test_a_vocabulary_the_text_probably_cannot_fill_is_warned_of(corpora, tmp_path):
    res = pipeline_main(["--corpus", str(corpora["short"]), "--workdir", str(tmp_path / "wd"), "--until", "vocab",
                         "--dry-run"])
    assert res.returncode == 0, res.stderr
    assert "warning: vocab.vocab_size=4000: a corpus of 1,350 bytes of text probably supports about" in res.stderr


def test_a_gpu_plan_that_does_not_fit_its_gpus_memory_is_refused_before_ray(corpora, tmp_path):
    """cpu-small's micro-batch of 16 x 128 on GPUs of 2.3 GB (2 GiB of them the plan's reserve): the dry run states
    the misfit and the largest micro-batch with and without checkpointing; the real run refuses it with the fixes,
    before Ray starts, whatever GPUs this machine has (the memory named outranks the device's own)."""
    args = ["--preset", "cpu-small", "--corpus", str(corpora["a"]), "--until", "pretrain", "--workdir",
            str(tmp_path / "wd"), "--set", "pretrain.use_gpu=true", "--set", "pretrain.gpu_memory_gb=2.3"]
    dry = pipeline_main([*args, "--dry-run"])
    assert dry.returncode == 0, dry.stderr
    assert "memory: 2.3 GB per GPU; it does not fit: pretrain: a GPU needs" in dry.stdout
    largest = re.search(r"largest micro-batch per GPU at the run's GPU, 2.3 GB, .*?: (\d+) \(none\), (\d+) \(all\)",
                        dry.stdout)
    assert largest and 1 <= int(largest[1]) < 16 <= int(largest[2]), dry.stdout[-3000:]
    real = pipeline_main(args)
    assert real.returncode == 2 and not (tmp_path / "wd").exists()
    assert f"set pretrain.micro_batch_size={largest[1]} or pretrain.activation_checkpointing=all" in real.stderr
