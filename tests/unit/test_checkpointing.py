"""Activation checkpointing (`pretrain.activation_checkpointing`) and ZeRO-Offload (`pretrain.offload`) change where
and when numbers are kept, not the numbers: the stage's own step (`stages.pretrain.loop.train_step`) on the
tiniest model, dropout on, gives the same losses over a few steps with and without checkpointing - MLM with the
EMD and RTD's generator and discriminator on a plain torch engine. The same through real DeepSpeed engines (ZeRO
0-3, checkpointing and offload) is bench/activation_memory.py's `deepspeed` section (a DeepSpeed process costs
half a minute here), and the stage runs both in tests/integration/test_pretrain.py's ZeRO-3 run."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from core.config import ConfigError, PretrainConfig, checkpoint_every, check_offload
from deberta.config import debug

MODEL = debug()  # dropout 0.1 on hidden states and attention probabilities
CFG = PretrainConfig(num_workers=1, micro_batch_size=2, train_batch_size=4, lr=1e-3, warmup_steps=0, max_steps=4)
STEPS = 3


def run_losses(objective_name: str, checkpointing: str = "none", ds: dict | None = None) -> list[float]:
    """Losses of STEPS optimizer steps (2 micro-batches each) of the stage's `train_step` on random rows; `ds`:
    PretrainConfig fields of a DeepSpeed engine on the process group the environment describes (plain torch
    without)."""
    from stages.pretrain.loop import optim_spec, train_step
    from stages.pretrain.objectives import objective_for
    from training.deepspeed_config import build_deepspeed_config
    from training.engine import build

    cfg = dataclasses.replace(CFG, objective=objective_name, activation_checkpointing=checkpointing, **(ds or {}))
    objective = objective_for(cfg)
    factory, init_module = objective.build_model(MODEL)
    ds_config = build_deepspeed_config(cfg, 1, use_gpu=False) if ds is not None else None
    engine = build(factory, optim_spec(cfg), ds_config=ds_config, seed=0, init_module=init_module,
                   checkpoint_every=checkpoint_every(cfg.activation_checkpointing))
    masker = objective.masker(MODEL.vocab_size, MODEL.vocab_size - 1, (0, 1, 2, 3),
                              torch.ones(MODEL.vocab_size, dtype=torch.bool))
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(STEPS):
        batches = [{"input_ids": torch.randint(5, MODEL.vocab_size - 1, (2, 32), generator=g)} for _ in range(2)]
        losses.append(train_step(engine, objective, masker, batches, step)["loss"])
    return losses


@pytest.fixture
def one_thread():
    """One torch thread: the tiny model steps in milliseconds, where two threads on a busy machine wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("objective_name", ["mlm", "rtd"])
def test_checkpointed_steps_equal_unchecked_ones_dropout_included(objective_name, one_thread):
    plain = run_losses(objective_name)
    assert len(set(plain)) == STEPS  # the model trains: the losses move
    for checkpointing in ("all", "every-2"):
        assert run_losses(objective_name, checkpointing) == pytest.approx(plain, abs=1e-6), checkpointing


def test_checkpointing_recomputes_the_layers_it_names():
    """every-K recomputes layers 0, K, 2K, ... (a forward pre-hook counts the runs of each layer in one step)."""
    from deberta.model import DebertaForMaskedLM, set_activation_checkpointing

    torch.manual_seed(0)
    model = DebertaForMaskedLM(MODEL.replace(num_hidden_layers=5)).train()
    runs = [0] * 5
    for depth, layer in enumerate(model.deberta.encoder.layer):
        layer.register_forward_pre_hook(lambda *_, d=depth: runs.__setitem__(d, runs[d] + 1))
    assert set_activation_checkpointing(model, 2) == 1
    ids = torch.randint(5, 100, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 1] = ids[0, 1]
    model(ids, labels=labels)["loss"].backward()
    # layers 0 and 2 twice (forward, recomputation); the last layer runs only in the EMD's passes (decode_pass)
    assert runs == [2, 1, 2, 1, 0]


def test_values_and_combinations_are_refused_before_ray():
    assert [checkpoint_every(v) for v in ("none", "all", "every-1", "every-3")] == [0, 1, 1, 3]
    for bad in ("every", "every-0", "2", "some"):
        with pytest.raises(ConfigError, match=r"pretrain.activation_checkpointing=.*every-K"):
            checkpoint_every(bad)
    check_offload("optimizer", 1, "pretrain")
    check_offload("optimizer+parameters", 3, "pretrain")
    with pytest.raises(ConfigError, match="ZeRO-0 shards none; set pretrain.zero_stage=1, 2 or 3"):
        check_offload("optimizer", 0, "pretrain")
    with pytest.raises(ConfigError, match="parameters only under ZeRO-3.*zero_stage=2"):
        check_offload("optimizer+parameters", 2, "pretrain")
    with pytest.raises(ConfigError, match="pretrain.offload='cpu'"):
        check_offload("cpu", 3, "pretrain")


def test_offload_is_deepspeeds_own_and_only_where_zero_shards_it():
    from training.deepspeed_config import build_deepspeed_config

    def zero(offload: str, stage: int) -> dict:
        cfg = dataclasses.replace(CFG, offload=offload, zero_stage=stage)
        return build_deepspeed_config(cfg, 1, use_gpu=True).to_dict()["zero_optimization"]

    assert "offload_optimizer" not in zero("none", 3) and "offload_param" not in zero("none", 3)
    assert zero("optimizer", 2)["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero("optimizer", 3)
    assert zero("optimizer+parameters", 3)["offload_param"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(ConfigError, match="ZeRO-3"):
        dataclasses.replace(CFG, offload="optimizer+parameters", zero_stage=2).check()
