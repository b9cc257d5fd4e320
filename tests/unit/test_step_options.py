"""The step's options (training.precision, training.engine, deberta.fused_attention): what is asked for is what runs,
or the run refuses; nothing falls back silently."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from core.config import ConfigError, PretrainConfig
from deberta.config import debug
from deberta.model import DebertaForMaskedLM
from stages.pretrain.objectives import check_config
from training import precision
from training.engine import OptimSpec, build

SPEC = OptimSpec(lr=1e-3, warmup_steps=0, total_steps=10)


def _batch(cfg, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (2, 16), generator=g)  # (B, T)
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    return ids, torch.ones_like(ids), labels


def _note(seen: dict, out: torch.Tensor) -> None:
    """A forward hook's body: the first output dtype seen (returning None leaves the output as it is)."""
    seen.setdefault("activation", out.dtype)


def _step_dtypes(engine, cfg) -> dict[str, torch.dtype]:
    """One training step; the dtype of a feed-forward output inside it, and of the weights and gradients after."""
    seen = {}
    dense = engine.module.deberta.encoder.layer[0].intermediate.dense
    handle = dense.register_forward_hook(lambda m, i, out: _note(seen, out))
    out = engine(*_batch(cfg))
    handle.remove()
    engine.backward(out["loss"])
    seen["grad"], seen["weight"] = dense.weight.grad.dtype, dense.weight.dtype
    engine.step()
    return seen


def test_precision_auto_takes_bf16_on_gpu_and_on_cpu_only_where_measured_faster():
    assert precision.resolve("auto", use_gpu=True, hidden_size=64) == "bf16"
    assert precision.resolve("auto", use_gpu=False, hidden_size=64) == "fp32"
    wide = "bf16" if precision.cpu_has_bf16() else "fp32"
    assert precision.resolve("auto", use_gpu=False, hidden_size=precision.AUTO_CPU_MIN_HIDDEN) == wide
    assert precision.resolve("bf16", use_gpu=False, hidden_size=64) == "bf16"  # asked for: never overruled
    assert precision.resolve("fp32", use_gpu=False, hidden_size=4096) == "fp32"
    assert precision.autocast_dtype("bf16", use_gpu=True, deepspeed=True) is None  # DeepSpeed's bf16 weights
    assert precision.autocast_dtype("bf16", use_gpu=False, deepspeed=True) == torch.bfloat16


def test_bf16_asked_for_on_a_cpu_that_emulates_it_says_what_it_costs():
    """One line when bf16 is asked for explicitly on a CPU without native bf16; nothing for `auto` or fp32 there,
    for a GPU, or for a CPU with native bf16 (this one, when `cpu_has_bf16()` says so)."""
    line = precision.emulated_cost("pretrain.precision", "bf16", use_gpu=False, native=False)
    assert line is not None and line.startswith("pretrain.precision=bf16 on a CPU without native bf16"), line
    assert "14x slower than fp32" in line and line.endswith("pretrain.precision=auto takes fp32 on this CPU"), line
    quiet = [("auto", False, False), ("fp32", False, False), ("bf16", True, False), ("bf16", False, True)]
    assert all(precision.emulated_cost("pretrain.precision", *case) is None for case in quiet)
    here = precision.emulated_cost("pretrain.precision", "bf16", use_gpu=False)
    assert (here is None) == precision.cpu_has_bf16()


@pytest.mark.parametrize("asked, activation", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_the_torch_engine_computes_in_the_asked_precision_over_fp32_weights(asked, activation):
    cfg = debug(vocab_size=300)
    engine = build(lambda: DebertaForMaskedLM(cfg), SPEC, seed=0,
                   autocast=precision.autocast_dtype(asked, use_gpu=False, deepspeed=False))
    assert _step_dtypes(engine, cfg) == {"activation": activation, "grad": torch.float32, "weight": torch.float32}
    assert engine.precision == ("bfloat16 autocast" if asked == "bf16" else "fp32")


def test_the_deepspeed_engine_computes_in_bf16_when_asked_with_fp32_gradients(tmp_path, monkeypatch):
    """One gloo rank, ZeRO-2: the forward pass in bf16, the gradients DeepSpeed reduces and the master weights fp32."""
    from tests.conftest import free_port
    from training.deepspeed_config import DeepSpeedConfig

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    cfg = debug(vocab_size=300)
    ds = DeepSpeedConfig(train_batch=2, micro=2, accumulation=1, grad_clip=1.0, zero_stage=2, use_gpu=False)
    engine = build(lambda: DebertaForMaskedLM(cfg), SPEC, ds_config=ds, seed=0,
                   autocast=precision.autocast_dtype("bf16", use_gpu=False, deepspeed=True))
    try:
        seen = {}
        dense = engine.module.deberta.encoder.layer[0].intermediate.dense
        handle = dense.register_forward_hook(lambda m, i, out: _note(seen, out))
        out = engine(*_batch(cfg))
        handle.remove()
        engine.backward(out["loss"])
        engine.step()
        assert seen["activation"] == torch.bfloat16 and dense.weight.dtype == torch.float32
        assert all(p.dtype == torch.float32 for g in engine.optimizer.param_groups for p in g["params"])
        assert engine.precision == "bfloat16 autocast"
    finally:
        torch.distributed.destroy_process_group()


def test_compile_asked_for_compiles_every_encoder_layer_in_place():
    """compile=True compiles the encoder layers, on plain torch and (the same call) under DeepSpeed; the module it
    saves keeps the model's own parameter names."""
    cfg = debug(vocab_size=300)
    engine = build(lambda: DebertaForMaskedLM(cfg), SPEC, seed=0, compile=True)
    layers = engine.module.deberta.encoder.layer
    assert engine.compiled and all(layer._compiled_call_impl is not None for layer in layers)
    assert engine.module.deberta.embeddings._compiled_call_impl is None  # the rest stays eager
    assert not any("_orig_mod" in k for k in engine.module.state_dict())
    plain = build(lambda: DebertaForMaskedLM(cfg), SPEC, seed=0)
    assert plain.module.deberta.encoder.layer[0]._compiled_call_impl is None and not plain.compiled


def test_compiled_layers_do_not_recompile_after_the_first_steps():
    """The stage's validation pass (eval, no grad) and train steps on compiled layers: one graph per mode for every
    layer, and nothing compiles again as the masked-target counts vary, a batch has padding, or validation comes
    back. Dynamo's guards decide recompilation whatever the backend, so a backend that counts the graphs it is handed
    and runs them as they are (skipping inductor's code generation) counts every compilation. Graphs, not frames:
    dynamo also visits Python frames it compiles nothing from, such as the audit hook `core.artifacts` installs."""
    from deberta.model import compile_layers
    from stages.pretrain.loop import optim_spec, train_step, validation_sums
    from stages.pretrain.objectives import objective_for

    cfg = debug(vocab_size=300)
    pcfg = PretrainConfig(num_workers=1, micro_batch_size=4, train_batch_size=4, lr=1e-3, warmup_steps=0, max_steps=9)
    objective = objective_for(pcfg)
    engine = build(objective.build_model(cfg)[0], optim_spec(pcfg), seed=0)
    masker = objective.masker(cfg.vocab_size, cfg.vocab_size - 1, (0, 1, 2, 3), torch.rand(cfg.vocab_size) < 0.5)
    g = torch.Generator().manual_seed(0)

    def batches(padded: bool = False) -> list[dict[str, torch.Tensor]]:
        ids = torch.randint(5, cfg.vocab_size - 1, (4, 32), generator=g)  # (B, T)
        if padded:
            ids[0, 20:] = 0
        return [{"input_ids": ids}]

    graphs = []

    def counted(gm: torch.fx.GraphModule, example_inputs) -> Callable:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        assert compile_layers(engine.module, backend=counted) == cfg.num_hidden_layers
        val = batches() + batches(padded=True)
        validation_sums(engine, objective, masker, val)
        train_step(engine, objective, masker, batches(), 0)
        assert len(graphs) == 2  # the eval graph and the train graph, shared by every layer
        for step in range(1, 5):
            train_step(engine, objective, masker, batches(padded=step == 2), step)
        validation_sums(engine, objective, masker, val)
        train_step(engine, objective, masker, batches(), 5)
        assert len(graphs) == 2
    finally:
        torch._dynamo.reset()


def test_the_fused_backend_refuses_where_it_cannot_run():
    """attn_impl=fused on a CPU: the config check names the fix before any stage, and the model itself refuses
    rather than running another backend under the fused name."""
    cfg = debug(vocab_size=300, attn_impl="fused")
    with pytest.raises(ConfigError, match="model.attn_impl=fused runs on CUDA GPUs only: set pretrain.use_gpu=true"):
        check_config(PretrainConfig(), cfg)
    check_config(PretrainConfig(), debug(vocab_size=300))  # sdpa: nothing to say
    with pytest.raises(RuntimeError, match="attn_impl='fused' needs a CUDA device"):
        DebertaForMaskedLM(cfg)(*_batch(cfg))


def test_the_dry_run_plans_at_the_utilisation_last_measured_on_a_gpu():
    import json
    from pathlib import Path

    from stages.pretrain import estimates

    path, mode = estimates.PLAN_MFU_SOURCE
    report = json.loads((Path(__file__).resolve().parents[2] / path).read_text())
    (row,) = [r for r in report["results"] if r["mode"] == mode]
    assert estimates.PLAN_MFU == pytest.approx(row["mfu"], abs=5e-5)
