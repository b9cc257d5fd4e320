"""ALBERT's sentence-order prediction (ALBERT §3.1, `pretrain.sop=true`) as an option on top of any objective.

The model side is the objective's own model built with `sop=True` (`deberta.model.SentenceOrderHead` on the final
[CLS] state; the loss added to the objective's). What this wrapper adds: the `sop_label` column of segment-pair
token shards, SOP's step and validation numbers (kept as counts, so a micro-batch without a sentence pair weighs
nothing in the accuracy), SOP's term in the validation loss, and the registry tag. Everything else is the wrapped
objective's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from stages.pretrain.objective import Export, Objective, Sums
from stages.segment_pairs import SOP_COLUMN

if TYPE_CHECKING:
    import torch
    from torch import nn

    from core.init_checkpoint import ExternalCheckpoint
    from deberta.config import DebertaConfig
    from deberta.masking import SpanMasker

SOP_STEP_METRICS = ("mlm_loss", "sop_loss", "sop_correct", "sop_count")
"""SOP's step numbers: the main loss apart, SOP's loss, and its pair counts (`finish_step_metrics` divides them)."""


class SentenceOrder(Objective):
    """`inner` with ALBERT's SOP loss added."""

    def __init__(self, inner: Objective):
        super().__init__(inner.cfg)
        self.inner = inner
        self.name = inner.name
        self.step_metrics = tuple(dict.fromkeys((*inner.step_metrics, *SOP_STEP_METRICS)))
        self.flops_note = inner.flops_note
        self.final_metrics = inner.final_metrics

    def check(self, model: DebertaConfig) -> list[str]:
        return self.inner.check(model)

    def build_model(self, model: "DebertaConfig") -> tuple[Callable[[], "nn.Module"], Callable[["nn.Module"], None]]:
        return self.inner.build_model(model)

    def continued_config(self, released: DebertaConfig, init: str, generator: ExternalCheckpoint | None
                         ) -> dict[str, Any]:
        return self.inner.continued_config(released, init, generator)

    def initial_weights(self, model: "DebertaConfig", init: str, generator_init: str = ""
                        ) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
        weights, notes = self.inner.initial_weights(model, init, generator_init)
        return weights, {**notes, "sop_head": "new (released checkpoints have none)"}

    def released_loss_inputs(self) -> dict[str, Any] | None:
        return self.inner.released_loss_inputs()

    def masker(self, tokenizer_len: int, mask_id: int, special_ids, word_start) -> "SpanMasker":
        return self.inner.masker(tokenizer_len, mask_id, special_ids, word_start)

    def eval_inputs(self, mask_step: int) -> dict[str, Any]:
        return self.inner.eval_inputs(mask_step)

    def activations(self, model: "DebertaConfig", shape, checkpoint_every: int):
        """The inner objective's: the SOP head works on one [CLS] state per sequence."""
        return self.inner.activations(model, shape, checkpoint_every)

    @property
    def shard_columns(self) -> tuple[str, ...]:
        return (*self.inner.shard_columns, SOP_COLUMN)

    def finish_step_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """SOP's mean counts become `sop_accuracy` (correct over the pairs seen)."""
        means = self.inner.finish_step_metrics(dict(means))
        correct, count = means.pop("sop_correct"), means.pop("sop_count")
        means["sop_accuracy"] = correct / count if count else float("nan")
        return means

    def eval_sums(self, outputs: Mapping[str, "torch.Tensor"]) -> Sums:
        count = float(outputs["sop_count"])
        return {**self.inner.eval_sums(outputs), "sop_loss_sum": float(outputs["sop_loss"]) * count, "sop_pairs": count,
                "sop_correct": float(outputs["sop_correct"])}

    def eval_metrics(self, sums: Sums) -> dict[str, float]:
        metrics = self.inner.eval_metrics(sums)
        pairs = max(sums["sop_pairs"], 1.0)
        metrics.update(val_mlm_loss=sums["mlm_loss_sum"] / max(sums["targets"], 1.0),
                       val_sop_loss=sums["sop_loss_sum"] / pairs, val_sop_accuracy=sums["sop_correct"] / pairs,
                       val_sop_pairs=sums["sop_pairs"])
        metrics["val_loss"] += metrics["val_sop_loss"]
        return metrics

    def eval_line(self, metrics: dict[str, float]) -> str:
        return self.inner.eval_line(metrics) + f" SOP accuracy {metrics['val_sop_accuracy']:.3f}"

    def train_flops_per_token(self, model: "DebertaConfig", seq_len: int) -> float:
        return self.inner.train_flops_per_token(model, seq_len)

    def parameter_counts(self, model: "DebertaConfig") -> dict[str, int]:
        return self.inner.parameter_counts(model)

    def plan_line(self, model: "DebertaConfig", counts: dict[str, int], largest: int) -> str:
        return self.inner.plan_line(model, counts, largest)

    def write_models(self, out: Path, model: "DebertaConfig", state_dict: dict, vocab_dir: Path) -> str:
        return self.inner.write_models(out, model, state_dict, vocab_dir)

    def export(self) -> Export:
        inner = self.inner.export()
        return dataclasses.replace(inner, tags={**inner.tags, "sop": True})
