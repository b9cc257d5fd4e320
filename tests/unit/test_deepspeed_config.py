"""DeepSpeed config builder, the pretrain stage's pre-flight checks, its --dry-run, and deberta.checkpoint (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.deepspeed_config import build_deepspeed_config
from deberta import checkpoint
from deberta.config import debug
from deberta.model import DebertaForMaskedLM, DebertaForSequenceClassification
from pipeline.config import ConfigError, PretrainConfig
from pipeline.presets import deberta_1_5b
from stages.base import StageInputError
from stages.pretrain import check_config, dry_run

CFG = PretrainConfig(num_workers=2, micro_batch_size=8, train_batch_size=32, lr=1e-3, warmup_steps=10, max_steps=100)


def test_batch_arithmetic_and_table8_schedule():
    ds = build_deepspeed_config(CFG, world_size=2, use_gpu=False)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is False and "optimizer" not in ds  # client torch AdamW
    sched = ds["scheduler"]
    assert sched["type"] == "WarmupDecayLR" and sched["params"]["warmup_type"] == "linear"
    assert sched["params"]["warmup_max_lr"] == 1e-3 and sched["params"]["total_num_steps"] == 100
    gpu = build_deepspeed_config(dataclasses.replace(CFG, zero_stage=3), world_size=2, use_gpu=True)
    assert gpu["bf16"]["enabled"] is True and gpu["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_paper_preset_is_2048_sequences_exactly():
    p = deberta_1_5b().pretrain
    ds = build_deepspeed_config(p, p.num_workers, use_gpu=True)
    per_step = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 128
    assert ds["train_batch_size"] == 2048 == per_step
    assert ds["zero_optimization"]["stage"] == 3 and ds["scheduler"]["params"]["warmup_num_steps"] == 10_000


@pytest.mark.parametrize("change, message", [
    (dict(train_batch_size=24), "must equal micro_batch_size x accumulation x workers"),
    (dict(train_batch_size=8), "must equal micro_batch_size x accumulation x workers"),
    (dict(zero_stage=4), "ZeRO stages are 0, 1, 2 and 3"),
    (dict(max_steps=0), "max_steps=0 must be >= 1"),
])
def test_bad_values_raise_one_clear_error(change, message):
    with pytest.raises(ConfigError, match=message):
        build_deepspeed_config(dataclasses.replace(CFG, **change), world_size=2, use_gpu=False)


def test_stage_checks_name_the_key_and_the_fix():
    model = debug(vocab_size=1100)
    with pytest.raises(StageInputError, match=r"pretrain.train_batch_size=24 .* pick a multiple of 16"):
        check_config(dataclasses.replace(CFG, train_batch_size=24), model)
    with pytest.raises(StageInputError, match="asks for 2 GPUs but the Ray cluster has 0"):
        check_config(dataclasses.replace(CFG, use_gpu=True), model, num_gpus=0)
    with pytest.raises(StageInputError, match="model.vocab_size=1100 < tokenizer length 1201"):
        check_config(CFG, model, tokenizer_len=1201)
    with pytest.raises(StageInputError, match="max_position_embeddings=128"):
        check_config(CFG, model, seq_len=256)
    with pytest.raises(StageInputError, match="placement_strategy"):
        check_config(dataclasses.replace(CFG, placement_strategy="RANDOM"), model)
    assert check_config(CFG, model, tokenizer_len=1001, seq_len=128, num_gpus=0)["train_batch_size"] == 32


def test_dry_run_plans_the_1_5b_on_16_nodes():
    cfg = deberta_1_5b()
    text = dry_run(cfg.pretrain, cfg.model)
    assert "16 node(s) x 8 H100 = 128 workers, ZeRO-3" in text
    assert "backbone 1,564,549,632" in text
    assert "2048 sequences x 512 tokens" in text and "1,048,576 tokens/step" in text
    assert "ZeRO-2" in text and "ZeRO-3" in text and "days" in text


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
    from cluster.deepspeed_config import build_finetune_config
    from pipeline.config import FinetuneConfig

    ds = build_finetune_config(FinetuneConfig(zero_stage=3, grad_clip=0.5), batch_size=48, world_size=8)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (48, 6, 1)
    assert ds["gradient_clipping"] == 0.5 and "scheduler" not in ds and "optimizer" not in ds
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["bf16"]["enabled"] is False  # FinetuneConfig.use_gpu is off: fp32 on CPU
    with pytest.raises(ConfigError, match="batch_size=20 cannot be split evenly over 8 workers"):
        build_finetune_config(FinetuneConfig(), batch_size=20, world_size=8)
