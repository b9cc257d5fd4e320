"""ALBERT's sentence-order prediction (ALBERT §3.1, `pretrain.sop=true`), composed onto any objective.

`with_sentence_order(MLM)` is the class `SentenceOrder` placed before `MLM`: each method below calls the
objective's own through `super()` and adds SOP's part, and every other question goes to the objective unchanged.
SOP's parts, all here: its head (the model option `sop=True`: `deberta.model.SentenceOrderHead` on the final [CLS]
state, its loss added to the objective's), the `sop_label` column of segment-pair token shards fed to the model as
`sop_labels`, its step and validation numbers (kept as counts, so a micro-batch without a sentence pair weighs
nothing in the accuracy) and their words in the progress lines, its term in the loss, and the registry tag.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping

from core.config import PretrainConfig
from stages.pretrain.objective import Export, Objective, Sums
from stages.segment_pairs import SOP_COLUMN

if TYPE_CHECKING:
    import torch

    from deberta.config import DebertaConfig

SOP_STEP_METRICS = ("mlm_loss", "sop_loss", "sop_correct", "sop_count")
"""SOP's step numbers: the main loss apart, SOP's loss, and its pair counts (`finish_step_metrics` divides them)."""


class SentenceOrder(Objective):
    """ALBERT's SOP loss added to the objective after this class in the MRO (`with_sentence_order`)."""

    reads_documents = False  # a sentence pair's row holds one document
    composed_with: type[Objective]
    """The objective SOP is added to (set by `with_sentence_order`)."""

    @property
    def title(self) -> str:
        return f"{super().title} + sop"

    @property
    def loss_terms(self) -> tuple[str, ...]:
        return *super().loss_terms, "SOP"

    @property
    def step_metrics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*super().step_metrics, *SOP_STEP_METRICS)))

    @property
    def progress_metrics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*super().progress_metrics, "mlm_loss", "sop_accuracy")))

    @property
    def model_inputs(self) -> dict[str, str]:
        return {**super().model_inputs, "sop_labels": SOP_COLUMN}

    def model_options(self) -> dict[str, Any]:
        return {**super().model_options(), "sop": True}

    def initial_weights(self, model: "DebertaConfig", init: str, generator_init: str = ""
                        ) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
        weights, notes = super().initial_weights(model, init, generator_init)
        return weights, {**notes, "sop_head": "new (released checkpoints have none)"}

    def finish_step_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """SOP's mean counts become `sop_accuracy` (correct over the pairs seen)."""
        means = super().finish_step_metrics(dict(means))
        correct, count = means.pop("sop_correct"), means.pop("sop_count")
        means["sop_accuracy"] = correct / count if count else float("nan")
        return means

    def eval_sums(self, outputs: Mapping[str, "torch.Tensor"]) -> Sums:
        count = float(outputs["sop_count"])
        return {**super().eval_sums(outputs), "sop_loss_sum": float(outputs["sop_loss"]) * count, "sop_pairs": count,
                "sop_correct": float(outputs["sop_correct"])}

    def eval_metrics(self, sums: Sums) -> dict[str, float]:
        metrics = super().eval_metrics(sums)
        pairs = max(sums["sop_pairs"], 1.0)
        metrics.update(val_mlm_loss=sums["mlm_loss_sum"] / max(sums["targets"], 1.0),
                       val_sop_loss=sums["sop_loss_sum"] / pairs, val_sop_accuracy=sums["sop_correct"] / pairs,
                       val_sop_pairs=sums["sop_pairs"])
        metrics["val_loss"] += metrics["val_sop_loss"]
        return metrics

    def eval_line(self, metrics: dict[str, float]) -> str:
        return super().eval_line(metrics) + f" SOP accuracy {metrics['val_sop_accuracy']:.3f}"

    def export(self) -> Export:
        export = super().export()
        return dataclasses.replace(export, tags={**export.tags, "sop": True})

    def __reduce__(self):
        """Pickled (Ray ships the objective to its workers) as its parts: the composed class is made at run time."""
        return _composed, (self.composed_with, self.cfg)


@functools.cache
def with_sentence_order(objective: type[Objective]) -> type[Objective]:
    """`objective` with ALBERT's SOP on top: `SentenceOrder` placed before it, one class per objective."""
    return type(f"{objective.__name__}WithSOP", (SentenceOrder, objective),
                {"__module__": __name__, "composed_with": objective})


def _composed(objective: type[Objective], cfg: PretrainConfig) -> Objective:
    return with_sentence_order(objective)(cfg)
