"""What a task kind needs of the settings is checked before Ray starts, by `--dry-run` as by the real run
(`TaskKind.check`, called where the task is resolved), and every preset's defaults satisfy every kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.datasets import site_packages_file
from pipeline.presets import PRESETS
from stages.finetune.kinds import KINDS
from tests.conftest import pipeline_main


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_kind_runs_on_every_preset_defaults(preset):
    cfg = PRESETS[preset]().finetune
    for kind in KINDS.values():
        kind.check(cfg, None)  # raises StageInputError naming the setting where a window could not advance


@pytest.fixture
def squad_dir(tmp_path) -> Path:
    """A SQuAD v1.1 task from the real records allennlp's test fixtures ship (two Notre Dame paragraphs)."""
    doc = json.loads(site_packages_file("allennlp/tests/fixtures/data/squad.json").read_text())
    paragraphs = [p for article in doc["data"] for p in article["paragraphs"]]
    d = tmp_path / "squad"
    d.mkdir()
    for split, ps in (("train", paragraphs[:1]), ("dev", paragraphs[1:])):
        (d / f"{split}.json").write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": ps}]}))
    return d


def test_a_span_task_is_planned_on_the_default_preset_and_a_stride_that_cannot_advance_is_refused(squad_dir,
                                                                                                   tmp_path):
    ok = pipeline_main(["--dry-run", "--workdir", str(tmp_path / "wd"), "--set", f"finetune.task={squad_dir}"])
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = pipeline_main(["--dry-run", "--workdir", str(tmp_path / "wd"), "--set", f"finetune.task={squad_dir}",
                         "--set", "finetune.doc_stride=31"])
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: finetune.doc_stride=31 leaves windows of "
                                                          "max_seq_len=64 no room to advance"), bad.stderr[-2000:]


def test_a_grid_value_is_named_as_typed(tmp_path):
    """`--set finetune.lr=-1` is named back as the user typed it, not as a Python tuple ("(-1.0,)")."""
    bad = pipeline_main(["--dry-run", "--workdir", str(tmp_path / "wd"), "--set", "finetune.lr=1e-05,-1"])
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: finetune.lr=1e-05,-1: each learning rate must be > 0", bad.stderr


def test_the_kinds_code_a_model_ships_imports_on_its_own(tmp_path):
    """`code_tree` (a registered model's `code_paths`) is self-sufficient: in an interpreter that sees only it and
    site-packages (no `site` processing, so not this repository's editable install), every kind imports, from
    there, and pulls in neither Ray nor torch."""
    import site
    import subprocess
    import sys

    from stages.finetune.kinds.base import code_tree

    roots = code_tree(tmp_path / "code")
    code = (f"import sys; sys.path[:0] = {[str(tmp_path / 'code')]!r}; sys.path += {site.getsitepackages()!r}\n"
            "from stages.finetune.kinds import KINDS\n"
            "print(sorted(KINDS), {type(k).__module__: sys.modules[type(k).__module__].__file__ "
            "for k in KINDS.values()}, 'ray' in sys.modules, 'torch' in sys.modules, sep='\\n')")
    probe = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    names, files, ray, torch = probe.stdout.splitlines()
    assert names == "['choice', 'sequence', 'span', 'token']" and ray == torch == "False"
    assert all(f.startswith(str(tmp_path / "code")) for f in eval(files).values()), files
    assert {p.name for p in roots} == {"stages", "core"}


def test_a_multiple_choice_directory_reads_indices_and_letters_and_refuses_what_it_cannot(tmp_path):
    """JSONL with "options" is the choice kind (before the sequence kind, which claims other JSONL); labels are
    indices or RACE's letters; a bad label, too few options or mixed option counts are one line naming the fix."""
    import json

    from core.errors import StageInputError
    from stages.finetune.tasks import resolve_task

    def write(d, train, dev):
        d.mkdir()
        for split, rows in (("train", train), ("dev", dev)):
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)

    q = {"context": "Reviews of Heat.", "question": "Which review liked it?", "options": ["dull", "superb", "bad"]}
    task = resolve_task(write(tmp_path / "ok", [{**q, "label": 1}, {**q, "label": "C"}], [{**q, "label": "a"}]))
    assert task.kind is KINDS["choice"] and task.num_labels == 1
    assert task.train.label == (1, 2) and task.dev.label == (0,) and task.dev.options == (("dull", "superb", "bad"),)
    for name, rows, message in (
            ("label", [{**q, "label": 3}], r"line 1: label 3 names no option of the 3 given; use 0..2"),
            ("letter", [{**q, "label": "maybe"}], r"neither an option index \(0..2\) nor a letter \(A..C\)"),
            ("one", [{**q, "options": ["only"], "label": 0}], "at least two non-empty texts"),
            ("mixed", [{**q, "label": 0}, {**q, "options": ["a", "b"], "label": 0}], r"\[2, 3\] options")):
        with pytest.raises(StageInputError, match=message):
            resolve_task(write(tmp_path / name, rows, [{**q, "label": 0}]))
