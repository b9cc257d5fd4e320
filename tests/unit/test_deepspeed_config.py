"""The DeepSpeed config builder, the training engine (schedule, weight decay), the pretrain stage's input checks and
--dry-run, and deberta.checkpoint (no Ray)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from training.deepspeed_config import build_deepspeed_config
from deberta import checkpoint
from deberta.config import debug
from deberta.heads import DebertaForSequenceClassification
from deberta.model import DebertaForMaskedLM
from core.config import PretrainConfig
from pipeline.presets import deberta_1_5b
from core.errors import StageInputError
from stages.pretrain import check_inputs, dry_run

CFG = PretrainConfig(num_workers=2, micro_batch_size=8, train_batch_size=32, lr=1e-3, warmup_steps=10, max_steps=100)


def test_batch_arithmetic_precision_and_no_scheduler_section():
    ds = build_deepspeed_config(CFG, world_size=2, use_gpu=False).to_dict()
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is False
    assert "optimizer" not in ds and "scheduler" not in ds  # client AdamW and schedule (training.engine)
    gpu = build_deepspeed_config(dataclasses.replace(CFG, zero_stage=3), world_size=2, use_gpu=True).to_dict()
    assert gpu["bf16"]["enabled"] is True and gpu["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_deepspeed_bf16_follows_the_precision_asked():
    """Precision is decided once (`training.precision`): on GPU DeepSpeed's bf16 mode is on for auto and bf16 and
    off for fp32 (never switched on because a GPU is there); on CPU it is off (bf16 there is autocast)."""
    from training.deepspeed_config import build_finetune_config

    for asked, want in (("auto", True), ("bf16", True), ("fp32", False)):
        pre = build_deepspeed_config(dataclasses.replace(CFG, precision=asked), 2, use_gpu=True).to_dict()
        ft = build_finetune_config(1.0, 2, True, 32, 2, precision=asked).to_dict()
        assert pre["bf16"]["enabled"] is ft["bf16"]["enabled"] is want, asked
        assert build_finetune_config(1.0, 2, False, 32, 2, precision=asked).to_dict()["bf16"]["enabled"] is False


def test_paper_preset_is_2048_sequences_exactly():
    p = deberta_1_5b().pretrain
    ds = build_deepspeed_config(p, p.num_workers, use_gpu=True).to_dict()
    per_step = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 128
    assert ds["train_batch_size"] == 2048 == per_step and ds["zero_optimization"]["stage"] == 3


def test_zero_stages_differ_in_one_place():
    """What each ZeRO stage changes: its JSON section, whether the model is built partitioned (zero.Init), whether
    the checkpoint is sharded; the typed config answers, the JSON is only written."""
    stages = {z: build_deepspeed_config(dataclasses.replace(CFG, zero_stage=z), 2, use_gpu=True) for z in range(4)}
    assert [ds.partitions_parameters for ds in stages.values()] == [False, False, False, True]
    assert [ds.sharded_checkpoint for ds in stages.values()] == [False, True, True, True]
    assert [ds.to_dict()["zero_optimization"].get("overlap_comm") for ds in stages.values()] == [None, None, True, True]
    lean = dataclasses.replace(stages[3], zero_options={"stage3_param_persistence_threshold": 0})
    assert lean.to_dict()["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def reference_lr(s: int, peak: float, warmup: int, total: int) -> float:
    """HF get_linear_schedule_with_warmup after s optimizer steps (s counted from 0)."""
    return peak * s / warmup if s < warmup else peak * max(0.0, (total - s) / (total - warmup))


def lrs_of(engine, steps: int) -> list[float]:
    """The lr each of the first `steps` optimizer steps used (read from the optimizer before stepping)."""
    seen = []
    for _ in range(steps):
        seen.append(engine.optimizer.param_groups[0]["lr"])
        engine(torch.ones(1, 4)).sum().backward()
        engine.step()
    return seen


PROBES = lambda w, t: (0, 1, w - 1, w, w + 1, t - 1)  # noqa: E731


SCHEDULE_CFG = PretrainConfig(num_workers=1, micro_batch_size=1, train_batch_size=1, lr=1e-3, warmup_steps=5,
                              max_steps=12)
SCHEDULE_WORKER = """
import json, os, sys
sys.path.insert(0, os.environ["TEST_DIR"])
from test_deepspeed_config import deepspeed_lrs
print("LRS " + json.dumps(deepspeed_lrs()))
sys.stdout.flush()
os._exit(0)  # skip teardown: gloo's threads can abort it
"""


def deepspeed_lrs() -> list[float]:
    """The learning rate of each step of a real (gloo, ZeRO-2) DeepSpeed engine; run in its own process (the
    process group and DeepSpeed's copy of it stay out of pytest's)."""
    from training.engine import build
    from stages.pretrain.loop import optim_spec

    cfg = SCHEDULE_CFG
    engine = build(lambda: torch.nn.Linear(4, 1), optim_spec(cfg), ds_config=build_deepspeed_config(cfg, 1, False),
                   seed=0)
    return lrs_of(engine, cfg.max_steps)


def test_pretraining_schedule_is_the_reference_linear_one_in_deepspeed(tmp_path):
    """DeepSpeed's own WarmupDecayLR was two steps late (lr 0 at steps 1-2, peak at W+2); the engine's client
    schedule is the reference formula at every probed step, through a real (gloo, ZeRO-2) DeepSpeed engine."""
    from pathlib import Path

    from conftest import run_gloo_ranks

    logs = run_gloo_ranks(SCHEDULE_WORKER, tmp_path, {"TEST_DIR": str(Path(__file__).parent)}, world=1)
    seen = json.loads(next(ln for ln in logs[0].splitlines() if ln.startswith("LRS "))[4:])
    cfg = SCHEDULE_CFG
    for s in PROBES(cfg.warmup_steps, cfg.max_steps):
        assert seen[s] == pytest.approx(reference_lr(s, 1e-3, 5, 12), abs=1e-12), s
    assert seen[0] == 0.0 and max(seen) == seen[5] == 1e-3


def test_finetuning_schedule_is_the_same_formula():
    from stages.finetune.trial import optim_spec, steps_per_epoch
    from training.engine import build
    from core.config import FinetuneConfig

    ft = FinetuneConfig(epochs=2)
    grid = {"lr": 2e-5, "warmup_steps": 3, "batch_size": 4, "seed": 0}
    spec = optim_spec(ft, grid, n_train=20)
    total = steps_per_epoch(20, 4) * 2
    assert spec.total_steps == total == 10
    seen = lrs_of(build(lambda: torch.nn.Linear(4, 1), spec), total)
    for s in PROBES(3, total):
        assert seen[s] == pytest.approx(reference_lr(s, 2e-5, 3, total), abs=1e-15), s


def test_one_weight_decay_rule():
    from training.engine import param_groups

    model = DebertaForMaskedLM(debug(vocab_size=300, num_hidden_layers=1))
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    off = {names[id(p)] for p in no_decay["params"]}
    assert off and all(n.endswith("bias") or "LayerNorm" in n for n in off)


def test_stage_checks_only_what_the_inputs_tell():
    model = deberta_1_5b().model
    with pytest.raises(StageInputError, match="model.vocab_size=128100 < tokenizer length 128200"):
        check_inputs(model, tokenizer_len=128_200, seq_len=512)
    with pytest.raises(StageInputError, match="max_position_embeddings=512"):
        check_inputs(model, tokenizer_len=128_001, seq_len=1024)
    check_inputs(model, tokenizer_len=128_001, seq_len=512)


def test_dry_run_plans_the_1_5b_on_16_nodes():
    cfg = deberta_1_5b()
    text = dry_run(cfg.pretrain, cfg.model)
    assert "16 node(s) x 8 H100 = 128 workers, ZeRO-3" in text
    assert "backbone 1,564,549,632" in text
    assert "2048 sequences x 512 tokens" in text and "1,048,576 tokens/step" in text
    assert "ZeRO-2" in text and "ZeRO-3" in text  # the step time and days: test_pipeline_cli recomputes them


# ----------------------------------------------------------------------------------------------- deberta.checkpoint

def test_checkpoint_round_trip_and_backbone_into_classifier(tmp_path):
    cfg = debug(vocab_size=300, num_hidden_layers=2)
    torch.manual_seed(0)
    mlm = DebertaForMaskedLM(cfg)
    checkpoint.save(mlm, cfg, tmp_path / "model")
    assert checkpoint.load_config(tmp_path / "model") == cfg
    again = DebertaForMaskedLM(cfg)
    assert checkpoint.load_into(again, tmp_path / "model") == []
    for k, v in mlm.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    clf = DebertaForSequenceClassification(cfg, num_labels=3, classifier_dropout=0.1)
    missing = checkpoint.load_into(clf, tmp_path / "model")
    assert missing and all(k.startswith(("pooler.", "classifier.")) for k in missing)
    assert torch.equal(clf.deberta.embeddings.word_embeddings.weight, mlm.deberta.embeddings.word_embeddings.weight)


def test_checkpoint_mismatch_is_one_clear_error(tmp_path):
    cfg = debug(vocab_size=300, num_hidden_layers=2)
    checkpoint.save(DebertaForMaskedLM(cfg), cfg, tmp_path / "model")
    with pytest.raises(checkpoint.CheckpointError, match="does not fit .*load_config"):
        checkpoint.load_into(DebertaForMaskedLM(cfg.replace(num_hidden_layers=3)), tmp_path / "model")
    with pytest.raises(checkpoint.CheckpointError, match="does not fit"):
        checkpoint.load_into(DebertaForMaskedLM(cfg.replace(vocab_size=400)), tmp_path / "model")
    with pytest.raises(checkpoint.CheckpointError, match="no model.pt"):
        checkpoint.load_state_dict(tmp_path)


def test_finetune_config_splits_the_batch_and_keeps_the_client_schedule():
    from training.deepspeed_config import build_finetune_config

    ds = build_finetune_config(grad_clip=0.5, zero_stage=3, use_gpu=False, batch_size=48, world_size=8).to_dict()
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (48, 6, 1)
    assert ds["gradient_clipping"] == 0.5 and "scheduler" not in ds and "optimizer" not in ds
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["bf16"]["enabled"] is False  # fp32 on CPU
