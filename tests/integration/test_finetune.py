"""The finetune stage on real tasks and a tiny real pretrained checkpoint: Tune sweep, SiFT, registry, errors.

The checkpoint is built in-process, not by stages/pretrain/__init__.py (`bench.tiny_pretrained`): a SentencePiece model (2k
pieces) trained with the vocab stage's trainer on real review and news text, then a `deberta.config.debug()` MLM
trained for a few hundred plain-torch steps on the same text, saved in the pretrain artifact's layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deberta import checkpoint
from deberta.heads import DebertaForSequenceClassification
from core.artifacts import Artifact
from core.config import FinetuneConfig
from pipeline.presets import GRID_1_5B, GRID_BASE, GRID_LARGE, PRESETS
from training.engine import OptimSpec, make_optimizer
from stages import finetune
from stages.finetune import data as ft_data
from stages.finetune import sweep as ft_sweep
from stages.finetune import trial as ft_trial
from core.errors import StageInputError
from stages.base import StageContext
from stages.finetune.kinds import sequence
from stages.finetune.kinds.base import fast_tokenizer
from stages.finetune.tasks import resolve_task
from core.tokenizer import Tokenizer
from tests.integration.mlflow_serve import serve_once
from tests.s3_server import s3_server  # noqa: F401  (the driver-kill sweep's Tune storage)

SEQ = 64
REPO = Path(__file__).resolve().parents[2]


def learned(accuracy: float, baseline: float, n: int) -> bool:
    """Did a classifier beat the majority class by more than chance allows on n dev examples? One that learned
    nothing predicts independently of the label: its expected accuracy is at most the majority share p, and over n
    examples its accuracy varies by sqrt(p (1 - p) / n) (0.013 on the 1,409 Rotten Tomatoes dev reviews); beating
    p by 3 of those happens by chance about once in 740 (one-sided normal tail; for the best of k trials, at most k
    times as often)."""
    return accuracy > baseline + 3 * math.sqrt(baseline * (1 - baseline) / n)


def _context(tmp: Path, tracker, art_id: str) -> StageContext:
    return StageContext(stage="finetune", artifact_id=art_id, workdir=tmp, scratch=tmp / "scratch", storage_path=str(tmp / "ray_results"),
                        tracker=tracker, lineage={"pretrain": "tiny-pretrain", "corpus": "news+reviews",
                                                  "vocab": "tiny-vocab"}, preset="debug")


# ----------------------------------------------------------------------------------------------- the grids

@pytest.mark.parametrize("preset, table9", [
    ("deberta-1.5b", dict(dropout=[0, 0.15, 0.3], warmup_steps=[50, 100, 500, 1000], lr=[1e-6, 3e-6, 5e-6],
                          batch_size=[16, 32, 64])),
    ("deberta-large", dict(dropout=[0, 0.1, 0.15], warmup_steps=[50, 100, 500, 1000], lr=[5e-6, 8e-6, 9e-6, 1e-5],
                           batch_size=[16, 32, 48, 64])),
    ("deberta-base", dict(dropout=[0, 0.1, 0.15], warmup_steps=[50, 100, 500, 1000],
                          lr=[1.5e-5, 2e-5, 3e-5, 4e-5], batch_size=[16, 32, 48, 64])),
])
def test_param_space_is_table9(preset, table9):
    grids = {"deberta-1.5b": GRID_1_5B, "deberta-large": GRID_LARGE, "deberta-base": GRID_BASE}
    cfg = PRESETS[preset]().finetune
    space = ft_sweep.param_space(cfg)
    assert space == {**{k: {"grid_search": v} for k, v in table9.items()}, "seed": {"grid_search": list(cfg.seeds)}}
    assert {k: list(v) for k, v in grids[preset].items()} == table9
    assert ft_sweep.grid_size(cfg) == np.prod([len(v) for v in table9.values()]) * len(cfg.seeds)
    assert cfg.epochs == 10 and cfg.adam_eps == 1e-6 and (cfg.adam_beta1, cfg.adam_beta2) == (0.9, 0.999)
    assert cfg.sift == (preset == "deberta-1.5b") and cfg.weight_decay == 0.01 and cfg.grad_clip == 1.0


# ----------------------------------------------------------------------------------------------- the sweep

def _overlapping(trial_dirs: dict[str, Path]) -> bool:
    """Did at least two trials run at the same time (from Tune's own per-result timestamps)?"""
    import pandas as pd

    spans = []
    for d in trial_dirs.values():
        prog = pd.read_csv(d / "progress.csv")
        spans.append((prog["timestamp"].iloc[0] - prog["time_this_iter_s"].iloc[0], prog["timestamp"].iloc[-1]))
    return any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for (b0, b1) in spans[i + 1:])


def _tensorboard(trial_dir: Path) -> tuple[dict, set[str], dict[str, float]]:
    """What TensorBoard reads from a trial's event files: the hparams of its session, the metric tags its HPARAMS
    view offers, and the last value of every scalar. Read with tensorboardX's protos (TFRecord framing: u64
    length, u32 crc, the Event, u32 crc), tensorboard itself being an optional extra."""
    import struct

    from tensorboardX.proto import event_pb2, plugin_hparams_pb2

    hparams, metrics, scalars = {}, set(), {}
    for path in sorted(trial_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                plugin = plugin_hparams_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                if v.tag == "_hparams_/experiment":
                    metrics |= {m.name.tag for m in plugin.experiment.metric_infos}
                elif v.tag == "_hparams_/session_start_info":
                    hparams = {k: h.number_value for k, h in plugin.session_start_info.hparams.items()}
                elif v.HasField("simple_value"):
                    scalars[v.tag] = v.simple_value
    return hparams, metrics, scalars


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_beats_baseline_and_registers_champion(tiny_pretrained, ray_local, mlflow_server, tmp_path, monkeypatch,
                                                    capsys):
    from mlflow.tracking import MlflowClient

    from core.lineage import Lineage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    lineage = Lineage(tmp_path)
    lineage.start("finetune-test", {"preset": "debug"}, ["finetune"])
    tracker = lineage.stage_run("finetune", "sweep-under-test", {"finetune": {}}, {}, cached=False)
    # two trials: enough to choose between and to run at once; their learning is what 2,000 examples show
    cfg = FinetuneConfig(task="rotten-tomatoes", dropout=(0.1,), warmup_steps=(10,), lr=(1e-3, 2e-3),
                         batch_size=(32,), epochs=2, max_seq_len=SEQ, max_train_examples=2_000,
                         max_concurrent_trials=2, cpus_per_trial=1)
    pre, vocab = tiny_pretrained
    task = resolve_task(cfg.task)
    model_cfg = checkpoint.load_config(pre.path / "model")
    out = tmp_path / "out"
    out.mkdir()
    started = time.time()
    result = finetune.run(cfg, model=model_cfg, inputs={"pretrain": pre, "vocab": vocab, "task": task}, out=out,
                          ctx=_context(tmp_path, tracker, "sweep-under-test"))
    printed = capsys.readouterr().out
    print(f"sweep: {time.time() - started:.0f}s, {result.metrics}, {result.summary}")

    # the sweep: every grid point ran under Tune, at least two at once, the best beats the majority class
    import pandas as pd

    table = pd.read_csv(out / "results.csv")
    assert len(table) == 2 and set(table["lr"]) == {1e-3, 2e-3} and set(table["dropout"]) == {0.1}
    assert (table["epochs"] == 2).all() and result.counts["trial_epochs"] == 4
    exp_dir = tmp_path / "ray_results" / "finetune-sweep-under-test"
    trial_dirs = {p.name: p for p in exp_dir.iterdir() if (p / "progress.csv").is_file()}
    assert len(trial_dirs) == 2 and _overlapping(trial_dirs)
    # watched live: the command is printed when the sweep starts, and every trial's event file gives TensorBoard's
    # HPARAMS view the trial's grid point and its best dev accuracy (the number selection ranks by)
    assert f"tensorboard --logdir {exp_dir} --host 127.0.0.1" in printed
    for d in trial_dirs.values():
        hparams, metrics, scalars = _tensorboard(d)
        row = table[table["trial_id"] == pd.read_csv(d / "progress.csv")["trial_id"].iloc[0]].iloc[0]
        assert {k: hparams[k] for k in ("dropout", "lr", "batch_size", "warmup_steps", "seed")} == \
            pytest.approx({k: float(row[k]) for k in ("dropout", "lr", "batch_size", "warmup_steps", "seed")})
        assert "ray/tune/best_dev_accuracy" in metrics
        assert scalars["ray/tune/best_dev_accuracy"] == pytest.approx(row["dev_accuracy"], abs=1e-6)
    baseline = result.metrics["majority_baseline"]
    best = result.metrics["best_dev_accuracy"]
    assert baseline == pytest.approx(0.5834, abs=1e-3) and learned(best, baseline, len(task.dev)), (best, baseline)
    assert (out / "sweep.png").stat().st_size > 1_000

    # the saved champion reproduces its dev accuracy
    saved = json.loads((out / "model" / "finetune.json").read_text())
    clf = DebertaForSequenceClassification(checkpoint.load_config(out / "model"), saved["num_labels"], 0.0)
    clf.load_state_dict(torch.load(out / "model" / "model.pt", weights_only=True))
    tok = Tokenizer.load(out / "model" / "tokenizer")
    dev = sequence.encode_split(fast_tokenizer(out / "model" / "tokenizer", SEQ), task.dev, SEQ, task.problem)
    assert ft_trial.evaluate(clf, dev, task.kind, "cpu")["accuracy"] == pytest.approx(best, abs=1e-6)

    # the registry: champion alias with lineage tags; every trial a nested run with per-epoch metrics
    client = MlflowClient(mlflow_server)
    mv = client.get_model_version_by_alias("deberta-debug-rotten-tomatoes", "champion")
    assert result.summary["finetune"].startswith(f"deberta-debug-rotten-tomatoes v{mv.version} ")
    assert mv.tags["pretrain"] == "tiny-pretrain" and mv.tags["corpus"] == "news+reviews"
    assert mv.tags["sweep"] == "sweep-under-test" and mv.tags["task"] == task.id
    trial_cfg = json.loads(mv.tags["trial_config"])
    assert set(trial_cfg) == {"dropout", "warmup_steps", "lr", "batch_size", "seed"}
    assert float(mv.tags["dev_accuracy"]) == pytest.approx(best, abs=1e-5)
    files = {f.path for f in client.list_artifacts(tracker.run_id, "model")}
    assert {"model/model.pt", "model/config.json", "model/finetune.json", "model/tokenizer"} <= files
    # ... an MLflow Model over hf/, which transformers loads with the task's label names, and onnx/ beside it
    assert mv.source.startswith("models:/")
    onnx = client.list_logged_model_artifacts(mv.source.removeprefix("models:/"), "artifacts/onnx")
    assert [f.path for f in onnx] == ["artifacts/onnx/model.onnx"] and (out / "onnx" / "model.onnx").is_file()
    assert re.fullmatch(r"model\.onnx: logits within \S+ of torch on 64 dev rows", mv.tags["onnx"]), mv.tags
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    exported = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    assert exported.config.id2label == {0: "rotten", 1: "fresh"} and len(AutoTokenizer.from_pretrained(out / "hf")) == len(tok)
    with torch.no_grad():
        ids = torch.from_numpy(dev.ids[:16].astype(np.int64))
        ours = clf.eval()(ids, (ids != 0).long())["logits"]
        theirs = exported(input_ids=ids, attention_mask=(ids != 0).long()).logits
    assert float((ours - theirs).abs().max()) <= 1e-5
    # ... and the registry version, loaded as users load it, reproduces the registered dev metric
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    champion = "models:/deberta-debug-rotten-tomatoes@champion"
    loaded = mlflow.pyfunc.load_model(champion)
    assert loaded.metadata.get_input_schema().input_names() == ["sentence1"]
    predicted = loaded.predict(pd.DataFrame({"sentence1": list(task.dev.text_a)}))
    gold = [task.labels[int(y)] for y in task.dev.label]
    # exactly: the same rows, batches and decoding as the dev metric (the sequence kind's code, shipped in the model)
    assert np.mean([p == g for p, g in zip(predicted["label"], gold)]) == pytest.approx(best, rel=1e-12)
    # ... and `mlflow models serve` serves that champion: real dev sentences in, the task's label names out
    sentences = pd.DataFrame({"sentence1": list(task.dev.text_a[:16])})
    served = serve_once(champion, mlflow_server, sentences, tmp_path / "serve.log")
    print(f"mlflow models serve {champion}: /ping after {served.seconds_to_ping:.1f} s, first answer after "
          f"{served.seconds_to_answer:.1f} s")
    assert [p["label"] for p in served.predictions] == list(predicted["label"][:16])
    assert [p["score"] for p in served.predictions] == pytest.approx(list(predicted["score"][:16]), abs=1e-6)
    assert {p["label"] for p in served.predictions} <= {"rotten", "fresh"}
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
    assert len(children) == 2
    for run in children:
        assert {"dropout", "warmup_steps", "lr", "batch_size", "seed"} <= set(run.data.params)
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "dev_accuracy")
        assert sorted(m.step for m in history) == [1, 2]


def _plain_transformers_directory(pre: Artifact, vocab: Artifact, out: Path) -> Path:
    """Someone else's checkpoint: the tiny pretrained MLM written by plain `transformers` alone, as people publish
    one: a DebertaV2Config spelled out as released DeBERTa-v3 configs are, DebertaV2ForMaskedLM.save_pretrained, and
    a DebertaV2Tokenizer over its spm.model, and that spm.model. Nothing of ours writes a file (no deberta.hf)."""
    import transformers

    from deberta.model import DebertaForMaskedLM

    cfg = checkpoint.load_config(pre.path / "model")
    config = transformers.DebertaV2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        hidden_act="gelu", hidden_dropout_prob=cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=0, initializer_range=0.02,
        layer_norm_eps=cfg.layer_norm_eps, relative_attention=True, max_relative_positions=cfg.max_relative_positions,
        position_buckets=cfg.position_buckets, pad_token_id=0, position_biased_input=False,
        pos_att_type=["p2c", "c2p"], share_att_key=cfg.share_att_key, norm_rel_ebd="layer_norm",
        conv_kernel_size=cfg.conv_kernel_size, conv_act="gelu", legacy=False)  # the MLM head named as ours
    ours = DebertaForMaskedLM(cfg)
    checkpoint.load_into(ours, pre.path / "model")
    model = transformers.DebertaV2ForMaskedLM(config)
    # the parameter names are HF's: the weights copy over by name (the EMD's position table has no HF place)
    missing, unexpected = model.load_state_dict({k: v for k, v in ours.state_dict().items()
                                                 if not k.startswith("emd.")}, strict=False)
    assert not unexpected and all("decoder" in k for k in missing), (missing, unexpected)  # the tied decoder
    model.save_pretrained(out)
    transformers.DebertaV2Tokenizer(vocab_file=str(vocab.path / "spm.model")).save_pretrained(out)
    # transformers 5 saves the tokenizer as tokenizer.json alone; released DeBERTa-v2/v3 directories ship spm.model
    shutil.copy(vocab.path / "spm.model", out / "spm.model")
    return out


@pytest.mark.ray
@pytest.mark.slow
def test_finetunes_a_plain_transformers_directory(tiny_pretrained, sweep_killed_and_resumed):
    """`python -m pipeline.run --pretrained DIR` on an HF DeBERTa-v2 directory written by plain `transformers`
    (holding the tiny pretrained MLM): the plan is the finetune stage alone on the directory's architecture, no
    pretrain or vocab artifact; the fine-tuned backbone is the directory's weights, moved a little by training (a
    short run at a small lr: that the checkpoint learns is the sweep tests' business), and the registry version
    names the directory and its digest. The run is the driver-kill test's (`sweep_killed_and_resumed`): its
    second attempt, which finished the sweep, is read here."""
    from itertools import takewhile

    import pandas as pd
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    pre, _ = tiny_pretrained
    run = sweep_killed_and_resumed
    hf_dir, wd, stdout = run.hf_dir, run.wd, run.second.stdout
    plan = [ln.split() for ln in takewhile(lambda ln: ln.startswith("  "), stdout.split("plan:\n", 1)[1].splitlines())]
    assert plan[0][0] == "finetune" and not any(r[0] in ("corpus", "vocab", "pretrain") for r in plan), stdout
    (art,) = (wd / "artifacts" / "finetune").iterdir()
    assert checkpoint.load_config(art / "model") == checkpoint.load_config(pre.path / "model")  # its architecture
    assert len(pd.read_csv(art / "results.csv")) == 2 and (art / "hf" / "model.safetensors").is_file()
    # 16 AdamW steps at lr <= 2e-5 move an entry by at most ~3e-4: a few % of these weights; a backbone that did
    # not start from the directory (a fresh init) would be as far from it as the weights are large (~140%)
    given, tuned = load_file(hf_dir / "model.safetensors"), torch.load(art / "model" / "model.pt", weights_only=True)
    for key in ("deberta.embeddings.word_embeddings.weight", "deberta.encoder.layer.0.attention.self.query_proj.weight",
                "deberta.encoder.layer.2.output.dense.weight"):
        moved = float((tuned[key] - given[key]).norm() / given[key].norm())
        assert moved < 0.05, (key, moved)

    client = MlflowClient(f"sqlite:///{wd / 'mlflow' / 'mlflow.db'}")
    version = client.get_model_version_by_alias("deberta-debug-rotten-tomatoes", "champion")
    params = client.get_run(version.run_id).data.params
    assert version.tags["init"] == params["init.source"] == str(hf_dir)
    assert version.tags["init_digest"] == params["init.digest"] and re.fullmatch(r"[0-9a-f]{16}", params["init.digest"])


# ----------------------------------------------------------------------------------------------- SiFT

@pytest.mark.parametrize("task_name", ["rotten-tomatoes", "lee-sts"])
def test_sift_changes_the_loss_and_still_trains(tiny_pretrained, task_name):
    pre, _ = tiny_pretrained
    task = resolve_task(task_name)
    tok = Tokenizer.load(pre.path / "tokenizer")
    cfg = FinetuneConfig(max_seq_len=SEQ, max_train_examples=512, sift=True)
    train, _ = ft_data.prepare_data(task, pre.path / "tokenizer", cfg)
    model_cfg = checkpoint.load_config(pre.path / "model")
    weights = ft_data.backbone_weights(pre.path / "model")
    torch.manual_seed(0)
    model = DebertaForSequenceClassification(model_cfg, task.num_labels, classifier_dropout=0.0, sift=True)
    ft_trial.load_backbone(model, weights)
    model.eval()  # no dropout: the two losses differ only by the SiFT term
    batch = ft_trial._batch(train, np.arange(32), "cpu", task.kind)
    plain, _ = ft_trial.train_step(model, batch, None)
    torch.manual_seed(1)
    with_sift, term = ft_trial.train_step(model, batch, cfg.sift_lambda)
    assert term > 0 and float(with_sift.detach()) == pytest.approx(float(plain.detach()) + term, rel=1e-5)

    # epochs over 128 examples with the SiFT term on: the total loss must fall by 15% within 8 (it stops once it has:
    # Lee's similarity scores after 2, the reviews' labels after 8)
    model.train()
    opt, _ = make_optimizer(model, OptimSpec(lr=1e-3, warmup_steps=0, total_steps=10**9))
    epochs, terms = [], []
    while len(epochs) < 8 and not (len(epochs) > 1 and epochs[-1] < 0.85 * epochs[0]):
        losses = []
        for start in range(0, 128, 32):
            batch = ft_trial._batch(train, np.arange(start, start + 32), "cpu", task.kind)
            loss, term = ft_trial.train_step(model, batch, cfg.sift_lambda)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            losses.append(float(loss.detach()))
            terms.append(term)
        epochs.append(np.mean(losses))
    assert epochs[-1] < 0.85 * epochs[0] and min(terms) > 0, (epochs, terms)


# ----------------------------------------------------------------------------------------------- bad input

def test_missing_or_broken_pretrained_artifact_is_one_clear_message(tiny_pretrained, tracker, tmp_path):
    pre, vocab = tiny_pretrained
    task = resolve_task("rotten-tomatoes")
    cfg = FinetuneConfig(max_seq_len=SEQ)
    model_cfg = checkpoint.load_config(pre.path / "model")
    ctx = _context(tmp_path, tracker, "bad")
    with pytest.raises(StageInputError, match="needs the pretrained checkpoint.*--until pretrain"):
        finetune.run(cfg, model=model_cfg, inputs={"vocab": vocab, "task": task}, out=tmp_path, ctx=ctx)
    empty = Artifact("pretrain", "gone", tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StageInputError, match="missing model/model.pt.*--force pretrain"):
        finetune.run(cfg, model=model_cfg, inputs={"pretrain": empty, "vocab": vocab, "task": task}, out=tmp_path,
                     ctx=ctx)
    other = model_cfg.replace(hidden_size=128)
    with pytest.raises(StageInputError, match="built for another model.*hidden_size"):
        finetune.run(cfg, model=other, inputs={"pretrain": pre, "vocab": vocab, "task": task}, out=tmp_path, ctx=ctx)


# ----------------------------------------------------------------------------------------------- DeepSpeed trials

def _sweep(cfg: FinetuneConfig, tiny_pretrained, tmp_path: Path, tracker, name: str):
    """finetune.run under a fresh output dir; returns (StageResult, out dir, results table)."""
    import pandas as pd

    pre, vocab = tiny_pretrained
    out = tmp_path / name
    out.mkdir()
    result = finetune.run(cfg, model=checkpoint.load_config(pre.path / "model"),
                          inputs={"pretrain": pre, "vocab": vocab, "task": resolve_task(cfg.task)}, out=out,
                          ctx=_context(tmp_path, tracker, name))
    return result, out, pd.read_csv(out / "results.csv")


@pytest.mark.ray
@pytest.mark.slow
def test_deepspeed_trial_of_one_worker_repeats_the_torch_trial(tiny_pretrained, ray_local, tracker, tmp_path):
    """Same grid point, same seed: one DeepSpeed worker (ZeRO-0, fp32) trains exactly what one torch process does.
    Equality holds at any size (128 examples, 8 steps: 2 of warmup, 6 of decay); that a trial learns is the sweep
    tests' business.
    The torch sweep with finetune.control=scratch: the same grid point and seed from the initial weights, and the
    registry version records the champion's gain over it."""
    point = dict(task="rotten-tomatoes", dropout=(0.1,), warmup_steps=(2,), lr=(1e-3,), batch_size=(32,), epochs=2,
                 max_seq_len=SEQ, max_train_examples=128, max_concurrent_trials=1)
    result, out, plain = _sweep(FinetuneConfig(**point, control="scratch"), tiny_pretrained, tmp_path, tracker, "plain")
    import pandas as pd

    scratch = pd.read_csv(out / "results_scratch.csv")
    assert len(scratch) == 1 and all(scratch[k][0] == plain[k][0] for k in ("lr", "batch_size", "dropout", "seed"))
    # other weights, not the pretrained model again (at 8 steps both may still predict the majority class)
    assert scratch["final_train_loss"][0] != pytest.approx(plain["final_train_loss"][0], rel=1e-3)
    version = re.search(r" v(\d+) ", result.summary["finetune"]).group(1)
    mv = tracker.client.get_model_version("deberta-debug-rotten-tomatoes", version)
    gain = plain["dev_accuracy"][0] - scratch["dev_accuracy"][0]  # one seed: the seed means are the values
    assert float(mv.tags["gain_over_scratch"]) == pytest.approx(gain, abs=1e-6)
    assert float(mv.tags["scratch_dev_accuracy"]) == pytest.approx(scratch["dev_accuracy"][0], abs=1e-6)
    assert result.metrics["gain_over_scratch"] == pytest.approx(gain, abs=1e-6)
    _, _, ds = _sweep(FinetuneConfig(**point, trainer="deepspeed", workers_per_trial=1, zero_stage=0),
                      tiny_pretrained, tmp_path, tracker, "ds")
    print(plain.iloc[0].to_dict(), ds.iloc[0].to_dict())
    assert ds["best_epoch"][0] == plain["best_epoch"][0]
    assert ds["final_train_loss"][0] == pytest.approx(plain["final_train_loss"][0], rel=1e-4)
    assert ds["dev_accuracy"][0] == pytest.approx(plain["dev_accuracy"][0], abs=1e-9)


@pytest.mark.ray
@pytest.mark.slow
def test_deepspeed_sweep_zero3_two_workers_with_sift(tiny_pretrained, ray_local, mlflow_server, tmp_path, monkeypatch):
    """trainer=deepspeed as the 1.5B preset runs it (ZeRO, SiFT), at 2 workers: each trial a Ray Train run; the
    weights gathered from the ZeRO-3 shards are the model that scored the reported dev metrics. On a regression
    task (Lee news-pair similarity), so the check holds at any size: the dev Pearson and Spearman of real-valued
    predictions are a fingerprint of the weights that made them, where a classifier that has not learned yet predicts
    one class, and any weights predicting that class match its metrics. That a trial learns is the plain sweep's
    test."""
    from mlflow.tracking import MlflowClient

    from core.lineage import Lineage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    lineage = Lineage(tmp_path)
    lineage.start("finetune-ds-test", {"preset": "debug"}, ["finetune"])
    tracker = lineage.stage_run("finetune", "ds-sweep", {"finetune": {}}, {}, cached=False)
    # One trial: choosing among trials is the plain sweep's test; this one is about a trial on ZeRO-3 workers.
    cfg = FinetuneConfig(task="lee-sts", dropout=(0.0,), warmup_steps=(4,), lr=(2e-3,), batch_size=(32,), epochs=1,
                         max_seq_len=SEQ, max_train_examples=256, max_concurrent_trials=1, trainer="deepspeed",
                         workers_per_trial=2, zero_stage=3, sift=True)
    result, out, table = _sweep(cfg, tiny_pretrained, tmp_path, tracker, "ds-sweep")
    print(f"deepspeed sweep: {result.metrics}, {result.summary}")

    assert len(table) == 1 and (table["epochs"] == 1).all()
    train_runs = [d for d in (tmp_path / "ray_results" / "finetune-ds-sweep-train").iterdir() if d.is_dir()]
    assert len(train_runs) == 1  # the trial is a Ray Train run
    exp_dir = tmp_path / "ray_results" / "finetune-ds-sweep"
    import pandas as pd

    for trial in (p for p in exp_dir.iterdir() if (p / "progress.csv").is_file()):
        progress = pd.read_csv(trial / "progress.csv")
        assert (progress["world_size"] == 2).all() and (progress["sift_loss"] > 0).all()

    # the weights gathered from the ZeRO-3 shards, evaluated in one plain process, give the reported dev metrics;
    # they are whole (a strict load: no shard left empty) and trained (the backbone moved from the checkpoint)
    task = resolve_task(cfg.task)
    best = result.metrics["best_dev_pearson"]
    saved = json.loads((out / "model" / "finetune.json").read_text())
    clf = DebertaForSequenceClassification(checkpoint.load_config(out / "model"), saved["num_labels"], 0.0)
    tuned = torch.load(out / "model" / "model.pt", weights_only=True)
    clf.load_state_dict(tuned)
    dev = sequence.encode_split(fast_tokenizer(out / "model" / "tokenizer", SEQ), task.dev, SEQ, task.problem)
    scored = ft_trial.evaluate(clf, dev, task.kind, "cpu")
    assert best != 0.0, "constant predictions (Pearson 0 by definition) would not tell weights apart"
    # within float rounding: the trial's forward ran on two ranks gathering ZeRO-3 shards, this one on whole weights
    assert scored["pearson"] == pytest.approx(best, abs=1e-4) and table["dev_pearson"][0] == pytest.approx(best)
    assert scored["spearman"] == pytest.approx(table["dev_spearman"][0], abs=1e-4)
    given = checkpoint.load_state_dict(tiny_pretrained[0].path / "model")
    key = "deberta.encoder.layer.0.attention.self.query_proj.weight"
    assert float((tuned[key] - given[key]).abs().max()) > 1e-4

    client = MlflowClient(mlflow_server)
    mv = client.get_model_version_by_alias("deberta-debug-lee-sts", "champion")
    assert mv.tags["sweep"] == "ds-sweep" and mv.tags["pretrain"] == "tiny-pretrain"
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
    assert len(children) == 1 and all(r.info.status == "FINISHED" for r in children)


# ----------------------------------------------------------------------------------------------- faults

FAULT_GRID = dict(task="rotten-tomatoes", dropout=(0.0,), warmup_steps=(10,), lr=(1e-3, 2e-3), batch_size=(32,),
                  epochs=2, max_seq_len=SEQ, max_train_examples=256)


def _progress(exp_dir: Path) -> dict[str, "pd.DataFrame"]:
    """trial id -> the rows Tune wrote for it so far (progress.csv: epoch, pid, ...)."""
    import pandas as pd

    out = {}
    for csv in exp_dir.glob("*/progress.csv"):
        rows = pd.read_csv(csv) if csv.stat().st_size else pd.DataFrame()
        if len(rows):
            out[rows["trial_id"].iloc[0]] = rows
    return out


def _descends_from_us(pid: int) -> bool:
    """Is `pid` a process this test session started (a Ray worker of `ray_local`, under its raylet)?"""
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            return False
    return False


def _kill_a_trial_after_its_first_epoch(exp_dir: Path, killed: list, deadline: float) -> None:
    """SIGKILL the process of the first trial that reported one epoch (its pid is in Tune's own results)."""
    while time.time() < deadline and not killed:
        try:
            for trial_id, rows in _progress(exp_dir).items():
                pid = int(rows["pid"].iloc[0])
                if len(rows) == 1 and _descends_from_us(pid) and b"ray::" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    killed.append((trial_id, pid))
                    return
        except (OSError, ValueError, KeyError):
            pass  # a file half-written, a process just gone: look again
        time.sleep(0.1)


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_survives_a_killed_trial_process(tiny_pretrained, ray_local, tracker, tmp_path):
    """A trial's process SIGKILLed after its first epoch: Tune retries it (finetune.max_failures) from that epoch's
    checkpoint, and the sweep finishes with every grid point, each trial one MLflow run with each epoch once."""
    import threading

    killed: list[tuple[str, int]] = []
    exp_dir = tmp_path / "ray_results" / "finetune-lost-trial"
    killer = threading.Thread(target=_kill_a_trial_after_its_first_epoch,
                              args=(exp_dir, killed, time.time() + 300), daemon=True)
    killer.start()
    cfg = FinetuneConfig(**FAULT_GRID, max_concurrent_trials=2, max_failures=1)
    result, out, table = _sweep(cfg, tiny_pretrained, tmp_path, tracker, "lost-trial")
    killer.join()
    assert killed, "no trial was killed"
    victim, pid = killed[0]

    assert len(table) == 2 and sorted(table["lr"]) == [1e-3, 2e-3] and (table["epochs"] == 2).all()
    rows = _progress(exp_dir)[victim]
    # retried in a new process, which resumed after epoch 1 from its checkpoint instead of repeating it
    assert list(rows["epoch"]) == [1, 2] and rows["pid"].iloc[0] == pid and rows["pid"].iloc[1] != pid, rows
    assert result.counts["trials"] == 2 and (out / "model" / "model.pt").is_file()
    children = tracker.client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
    assert sorted(r.data.tags["tune.trial_id"] for r in children) == sorted(table["trial_id"])
    for run in children:
        assert run.info.status == "FINISHED"
        assert [m.step for m in tracker.client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2]


def _experiment_state(fs, exp_dir: str) -> dict[str, str]:
    """trial id -> status, as the Tune driver last saved its experiment state in its storage (`fs`, `exp_dir`)."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(exp_dir, allow_not_found=True))
    states = sorted(i.path for i in infos if i.base_name.startswith("experiment_state-") and i.base_name.endswith(".json"))
    if not states:
        return {}
    try:
        trials = json.loads(fs.open_input_stream(states[-1]).read())["trial_data"]
    except (OSError, ValueError):  # Tune rewrites the object in place: read mid-copy, it is read again at the next poll
        return {}
    return {t["trial_id"]: t["status"] for t in (json.loads(state) for state, _ in trials)}


DRIVER_KILL_GRID = {**FAULT_GRID, "lr": (1e-5, 2e-5)}
"""Two grid points at a small lr: the resumed sweep is also `test_finetunes_a_plain_transformers_directory`'s run,
whose backbone must stay near the directory's weights."""


@dataclasses.dataclass(frozen=True)
class KilledAndResumed:
    """What `sweep_killed_and_resumed` did and saw."""

    hf_dir: Path
    """The `--pretrained` directory (written by plain transformers)."""
    wd: Path
    fs: "pafs.FileSystem"
    exp: str
    """The Tune experiment in the bucket."""
    states: dict[str, str]
    """trial id -> status in the experiment state when the first attempt was killed."""
    before: dict[str, "pd.DataFrame"]
    """trial id -> its progress.csv rows in the bucket after the kill."""
    cut: str
    """The cut-short experiment state planted before the second attempt."""
    state: bytes
    """The whole state it is half of."""
    second: subprocess.CompletedProcess
    after: dict[str, "pd.DataFrame"]
    """trial id -> its progress.csv rows in the bucket after the second attempt."""


@pytest.fixture(scope="module")
def sweep_killed_and_resumed(tiny_pretrained, s3_server, tmp_path_factory) -> KilledAndResumed:  # noqa: F811
    """`python -m pipeline.run --pretrained DIR` (DIR written by plain transformers, Tune's storage in a bucket)
    killed with everything it started (its own PID namespace) once one trial of two has finished; a newer experiment
    state cut short planted beside the one it left; then the same command again, to its end."""
    import pyarrow.fs as pafs

    pre, vocab = tiny_pretrained
    tmp_path = tmp_path_factory.mktemp("driver-kill")
    hf_dir = _plain_transformers_directory(pre, vocab, tmp_path / "someone-elses-deberta")
    wd, fs, sweeps = tmp_path / "wd", s3_server.filesystem(), f"{s3_server.bucket}/sweeps"
    sets = [f"finetune.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in DRIVER_KILL_GRID.items()]
    sets += ["ray.num_cpus=2", "ray.dashboard=false", "finetune.max_concurrent_trials=1",
             f"ray.storage_path=s3://{sweeps}"]
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "pipeline.run",
           "--pretrained", str(hf_dir), "--workdir", str(wd), *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(s3_server.env, TUNE_GLOBAL_CHECKPOINT_S="1")  # the driver saves its state at most a second stale

    def experiments() -> list[str]:
        return [i.path for i in fs.get_file_info(pafs.FileSelector(sweeps, allow_not_found=True))
                if i.type == pafs.FileType.Directory and i.base_name.startswith("finetune-")
                and not i.base_name.endswith("-train")]

    def progress(exp: str, name: str) -> dict[str, "pd.DataFrame"]:  # a local copy of what the bucket holds
        pafs.copy_files(exp, str(tmp_path / name), source_filesystem=fs)
        return _progress(tmp_path / name)

    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline, states, exps = time.time() + 600, {}, []
        while time.time() < deadline and first.poll() is None:
            exps = experiments()
            states = _experiment_state(fs, exps[0]) if exps else {}
            if sorted(states.values()) == ["RUNNING", "TERMINATED"]:
                break
            time.sleep(0.2)
        first.kill()  # unshare: with --kill-child its PID namespace, Ray included, dies with it
        first.wait(timeout=60)
    assert sorted(states.values()) == ["RUNNING", "TERMINATED"], (states, (tmp_path / "first.log").read_text()[-3000:])
    exp = exps[0]
    before = progress(exp, "before")
    # a later attempt killed while Tune copied its state to storage leaves that object cut short, and it is the
    # newest: the restore sets it aside and takes this attempt's
    newest = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(exp))
                    if i.base_name.startswith("experiment_state-"))[-1]
    state = fs.open_input_stream(newest).read()
    cut = f"{exp}/experiment_state-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    with fs.open_output_stream(cut, compression=None) as out:
        out.write(state[: len(state) // 2])

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return KilledAndResumed(hf_dir=hf_dir, wd=wd, fs=fs, exp=exp, states=states, before=before, cut=cut, state=state,
                            second=second, after=progress(exp, "after"))


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_resumes_after_its_driver_is_killed(sweep_killed_and_resumed):
    """`python -m pipeline.run` killed with everything it started (its own PID namespace) once one trial of two has
    finished, then run again: the Tune experiment is restored, the finished trial is not run again, the other
    continues, and each trial has exactly one MLflow run, under the stage run that finished the sweep. A newer
    experiment state cut short, as a driver killed while Tune copies it leaves it, is set aside, not read. Tune's
    storage is in a bucket (`ray.storage_path=s3://...`), as on a cluster: the restore reads it from there."""
    import pandas as pd
    import pyarrow.fs as pafs
    from mlflow.tracking import MlflowClient

    run = sweep_killed_and_resumed
    wd, fs, exp, states, before, after, cut = run.wd, run.fs, run.exp, run.states, run.before, run.after, run.cut
    assert not (wd / "ray_results").exists()  # Tune kept its experiment in the bucket, not in the workdir
    done = next(t for t, s in states.items() if s == "TERMINATED")
    art_id = exp.rsplit("/", 1)[1].removeprefix("finetune-")
    table = pd.read_csv(wd / "artifacts" / "finetune" / art_id / "results.csv")
    # the same Tune trials (restored, not a fresh grid); the finished one untouched, the other one completed
    assert sorted(table["trial_id"]) == sorted(states) and (table["epochs"] == 2).all()
    assert after[done].equals(before[done]) and list(after[done]["epoch"]) == [1, 2]
    assert {int(e) for t in states for e in after[t]["epoch"]} == {1, 2}

    client = MlflowClient(f"sqlite:///{wd / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("deberta-pipeline")
    stage = client.search_runs([experiment.experiment_id], "tags.`pipeline.stage` = 'finetune' and "
                                                           "attributes.status = 'FINISHED'")
    trials = client.search_runs([experiment.experiment_id], f"tags.`tune.experiment` = 'finetune-{art_id}'")
    assert len(stage) == 1 and sorted(r.data.tags["tune.trial_id"] for r in trials) == sorted(states)
    for trial in trials:
        assert trial.info.status == "FINISHED" and trial.data.tags["mlflow.parentRunId"] == stage[0].info.run_id
        assert [m.step for m in client.get_metric_history(trial.info.run_id, "train_loss")] == [1, 2]
    assert "resuming the Tune experiment" in run.second.stdout
    assert fs.get_file_info(cut).type == pafs.FileType.NotFound
    assert fs.open_input_stream(f"{cut}.cut-short").read() == run.state[: len(run.state) // 2]
    assert f"{cut.rsplit('/', 1)[1]}.cut-short" in run.second.stdout


def test_an_unrestorable_experiment_in_a_bucket_is_set_aside_whole(s3_server, monkeypatch):  # noqa: F811
    """A Tune experiment in a bucket with only a cut-short state is moved aside object by object (an object store
    has no directory to rename), so the sweep can start over under the same name; nothing is lost."""
    import pyarrow.fs as pafs

    fs, root = s3_server.filesystem(), f"{s3_server.bucket}/unrestorable/finetune-abc"
    objects = {"tuner.pkl": b"\x80\x04K\x01.", "trial_0/result.json": b"{}\n",
               "experiment_state-2026-01-01_00-00-00.json": b'{"trial_d'}
    for rel, data in objects.items():
        with fs.open_output_stream(f"{root}/{rel}", compression=None) as out:
            out.write(data)
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    assert ft_sweep.prepare_restore(f"s3://{root}") is False
    assert fs.get_file_info(root).type == pafs.FileType.NotFound
    (aside,) = [i.path for i in fs.get_file_info(pafs.FileSelector(root.rsplit("/", 1)[0]))]
    assert aside.startswith(f"{root}.unrestorable-")
    # every object moved, the cut-short state renamed out of Tune's pattern on the way
    moved = {rel + ".cut-short" if rel.startswith("experiment_state-") else rel: data for rel, data in objects.items()}
    assert {rel: fs.open_input_stream(f"{aside}/{rel}").read() for rel in moved} == moved
