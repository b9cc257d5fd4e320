"""What a re-run of the fine-tuning stage restores from, when a killed driver left Tune's state files cut short
(the whole kill-and-restore path is tests/integration/test_finetune.py::test_sweep_resumes_after_its_driver_is_killed)."""

from __future__ import annotations

import json
import pickle

from stages.finetune.sweep import prepare_restore


def _experiment(root, states: dict[str, bytes], tuner: bytes):
    exp = root / "finetune-abc"
    (exp / "trial_0").mkdir(parents=True)
    (exp / "trial_0" / "result.json").write_text("{}\n")
    (exp / "tuner.pkl").write_bytes(tuner)
    for name, data in states.items():
        (exp / f"experiment_state-{name}.json").write_bytes(data)
    return exp


def test_no_experiment_is_nothing_to_restore(tmp_path):
    assert prepare_restore(str(tmp_path / "finetune-none")) is False
    assert list(tmp_path.iterdir()) == []


def test_only_a_cut_short_state_moves_the_experiment_aside_whole(tmp_path, capsys):
    state = json.dumps({"trial_data": [], "runner_data": {}}).encode()
    exp = _experiment(tmp_path, {"2026-12-03_10-00-00": state[:7]}, pickle.dumps({"a": 1}))
    assert prepare_restore(str(exp)) is False
    assert not exp.exists()
    (aside,) = tmp_path.glob("finetune-abc.unrestorable-*")
    assert sorted(p.name for p in aside.iterdir()) == ["experiment_state-2026-12-03_10-00-00.json.cut-short",
                                                      "trial_0", "tuner.pkl"]
    assert (aside / "trial_0" / "result.json").read_text() == "{}\n"  # nothing deleted
    assert str(aside) in capsys.readouterr().out


def test_a_cut_short_tuner_pickle_is_not_restored(tmp_path):
    state = json.dumps({"trial_data": []}).encode()
    tuner = pickle.dumps({"param_space": list(range(100))})
    exp = _experiment(tmp_path, {"2026-12-03_10-00-00": state}, tuner[:-5])
    assert prepare_restore(str(exp)) is False and not exp.exists()


def test_whole_states_are_kept_and_cut_short_ones_renamed_out_of_tunes_pattern(tmp_path):
    state = json.dumps({"trial_data": [], "runner_data": {}}).encode()
    exp = _experiment(tmp_path, {"2026-12-03_10-00-00": state, "2026-12-03_11-00-00": state[:-1],
                                 "2026-12-03_12-00-00": b""}, pickle.dumps({"a": 1}))
    assert prepare_restore(str(exp)) is True
    assert sorted(p.name for p in exp.glob("experiment_state-*")) == [
        "experiment_state-2026-12-03_10-00-00.json", "experiment_state-2026-12-03_11-00-00.json.cut-short",
        "experiment_state-2026-12-03_12-00-00.json.cut-short"]
    assert (exp / "experiment_state-2026-12-03_10-00-00.json").read_bytes() == state
