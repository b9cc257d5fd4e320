"""The memory plan (`deberta.activations`, `stages.pretrain.estimates`): the activation count against what autograd
really keeps (every tensor saved for the backward pass, read through `saved_tensors_hooks`, parameters left out), and
the arithmetic of the largest micro-batch. The count against measured peak memory, with and without checkpointing,
is bench/activation_memory.py's (bench/README.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deberta.activations import Shape, layer_bytes, mlm_activations
from deberta.model import DebertaForMaskedLM, DebertaModel
from pipeline.presets import MODEL_CPU_SMALL, deberta_1_5b

B, T = 2, 64
CPU = Shape(T, B, value_bytes=4, device="cpu")


def saved_bytes(model: torch.nn.Module, *args, **kwargs) -> tuple[int, dict]:
    """Bytes of the distinct tensors (storages) autograd keeps for the backward pass of `model(*args)`, parameters
    excluded, and the outputs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    return sum(seen.values()), out


def _ids() -> torch.Tensor:
    return torch.randint(5, 1000, (B, T), generator=torch.Generator().manual_seed(0))


def test_one_layer_keeps_what_the_count_says():
    """The difference between a 3- and a 2-layer encoder (dropout on, cpu-small's layer) is one layer's count."""
    torch.manual_seed(0)
    sizes = [saved_bytes(DebertaModel(MODEL_CPU_SMALL.replace(num_hidden_layers=n)).train(), _ids())[0]
             for n in (2, 3)]
    assert sizes[1] - sizes[0] == pytest.approx(layer_bytes(MODEL_CPU_SMALL, CPU), rel=0.03)


def test_the_mlm_step_keeps_what_the_count_says():
    """The whole MLM step (L-1 layers, the EMD's two passes, the head) keeps its count; the logits it returns too."""
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]  # 10 targets per row: the count's ceil(fraction x 64) at fraction 10/64
    torch.manual_seed(0)
    kept, out = saved_bytes(DebertaForMaskedLM(MODEL_CPU_SMALL).train(), ids, labels=labels)
    kept += out["logits"].untyped_storage().nbytes()
    plan = mlm_activations(MODEL_CPU_SMALL, CPU, 0, target_fraction=10 / 64)
    assert kept == pytest.approx(plan.kept, rel=0.05)
    assert plan.held == out["logits"].untyped_storage().nbytes()  # what the step holds until its backward ends
    ckpt = mlm_activations(MODEL_CPU_SMALL, CPU, 1, target_fraction=10 / 64)
    # a checkpointed layer keeps its input alone: 3 x (layer - input) less, one layer recomputed at its backward
    assert plan.kept - ckpt.kept == 3 * (layer_bytes(MODEL_CPU_SMALL, CPU) - T * B * MODEL_CPU_SMALL.hidden_size * 4)
    assert ckpt.recompute == layer_bytes(MODEL_CPU_SMALL, CPU) and plan.recompute == 0


def test_largest_micro_batch_is_the_largest_that_fits():
    from stages.pretrain.estimates import GB, RESERVE_BYTES, memory_plan
    from stages.pretrain.objectives import objective_for

    cfg = deberta_1_5b()
    p = dataclasses.replace(cfg.pretrain, activation_checkpointing="every-4")
    # the 1.5B's parameter counts given, not counted on a meta model: the arithmetic is what is tested
    plan = memory_plan(p, objective_for(p), cfg.model, 512, total=1_567_828_068, largest=196_761_600)
    assert plan.per_sequence[0] > plan.per_sequence[4] > plan.per_sequence[1]
    for every in (0, 1, 4):
        for memory in (24 * GB, 80 * GB):
            n = plan.largest_micro(memory, every)
            assert n >= 1 and plan.needs(n, every) <= memory - RESERVE_BYTES < plan.needs(n + 1, every), (every, memory)
