"""What a pretraining objective supplies; everything else (data order, engine, checkpoints, recovery) is shared.

An `Objective` is built from the stage's `PretrainConfig` (`stages.pretrain.objectives.objective_for`, the one
place that reads `pretrain.objective` and `pretrain.sop`) and answers every question on which MLM and RTD differ:
its model and per-module init, its span masker, the columns its batch reads, the numbers it logs per step and per
validation pass (sums as named dicts, added over batches and workers) and the words of its progress lines, what
its loss is called, what it writes into the artifact and the registry, its training FLOPs and its line of the
dry-run plan. The loop (`loop.py`) and the registry (`registry.py`) name none of these: they ask.

The implementations are `mlm.py` (DeBERTa §3.2), `rtd.py` (DeBERTaV3 §2-3) and `sop.py`, ALBERT's sentence-order
prediction (ALBERT §3.1), composed onto either as a class placed before it (`sop.with_sentence_order`), whose
methods call the objective's own through `super()` and add SOP's part. A new objective is one more file like
`mlm.py`, listed in `objectives.py`.

Top-level imports stay torch-free (the driver module imports this at pipeline start-up); the model library is
imported inside the methods that build or export models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from core.config import PretrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from core.init_checkpoint import ExternalCheckpoint
    from deberta.activations import Activations, Shape
    from deberta.config import DebertaConfig
    from deberta.masking import SpanMasker

Sums = dict[str, float]
"""One validation pass's totals by name (e.g. `targets`, `mlm_loss_sum`), summed over batches and workers."""


@dataclass(frozen=True)
class Export:
    """How the registry version of a pretrained model is logged (`stages.pretrain.registry.register`)."""

    description: str
    """The model, e.g. "DeBERTa MLM+EMD"; the driver appends steps and ZeRO stage."""
    task: str
    """The MLflow Model's task over hf/ (`core.hf_pyfunc`): fill-mask or feature-extraction."""
    example: str
    """Input example of the MLflow Model."""
    extra_dirs: tuple[str, ...] = ()
    """Artifact directories logged beside model/ (RTD's generator/)."""
    tags: Mapping[str, Any] = field(default_factory=dict)
    """Registry tags naming the objective and its settings."""


class Objective:
    """The base every objective extends: the MLM family's defaults, overridden where an objective differs."""

    name = ""
    """The value of `pretrain.objective` it implements."""
    step_metrics: tuple[str, ...] = ()
    """Per-step numbers logged besides `loss` and averaged over micro-batches and workers (model outputs)."""
    progress_metrics: tuple[str, ...] = ()
    """Step metrics (after `finish_step_metrics`) the progress line shows after `loss`, in this order."""
    final_metrics: tuple[str, ...] = ("val_loss", "val_accuracy", "val_perplexity", "val_mlm_loss")
    """Validation numbers whose last value goes into metrics.json and the stage's result (those logged)."""
    loss_terms: tuple[str, ...] = ()
    """What `loss` and `val_loss` add up, term by term (`loss_label`)."""
    reads_documents = False
    """Whether its model takes `document_ids` (pretrain.document_mask: attention inside each packed document)."""

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg

    @property
    def title(self) -> str:
        """How the run's first line and the config errors name it."""
        return self.name

    @property
    def loss_label(self) -> str:
        """What `loss` is, for the loss curve's axis and the run's summary, e.g. "MLM + SOP loss"."""
        return f"{' + '.join(self.loss_terms)} loss" if self.loss_terms else "loss"

    # ------------------------------------------------------------------------------------------------ checks
    def check(self, model: DebertaConfig) -> list[str]:
        """Problems with this objective's settings, alone and against the [model] section (messages naming the fix).
        An objective checks the fields it reads; this base has no generator to start from."""
        if self.cfg.generator_init:
            return [f"pretrain.generator_init={self.cfg.generator_init}: the {self.name} objective has no generator; "
                    f"drop generator_init"]
        return []

    # ------------------------------------------------------------------------------------------------- model
    def build_model(self, model: "DebertaConfig") -> tuple[Callable[[], "nn.Module"], Callable[["nn.Module"], None]]:
        """(model factory, per-module init that ZeRO-3 re-runs on gathered modules)."""
        raise NotImplementedError

    def initial_weights(self, model: "DebertaConfig", init: str, generator_init: str = ""
                        ) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
        """Continued pretraining (`pretrain.init`): the model's starting weights from the released HF directory
        `init` (a subset of its state dict; the rest keeps its fresh init) and a note per part saying where it came
        from (`deberta.continue_from`). ValueError naming the part that does not fit."""
        raise NotImplementedError

    def continued_config(self, released: DebertaConfig, init: str, generator: ExternalCheckpoint | None
                         ) -> dict[str, Any]:
        """Continued pretraining: the `pretrain` fields that the released checkpoint (its config `released`, its HF
        directory `init`) and the given generator decide, {field: value}; ConfigError where a setting contradicts
        them. Decided on the driver before Ray starts (`stages.pretrain.continued.prepare`)."""
        return {}

    def released_loss_inputs(self) -> dict[str, Any] | None:
        """Extra model inputs that make a validation pass compute the loss `transformers` computes for the released
        checkpoint (logged once, before the first step of a continued run), or None where there is no such loss."""
        return None

    def released_loss(self, metrics: dict[str, float]) -> tuple[str, float]:
        """(what it is, its value): the number of a validation pass with `released_loss_inputs` that transformers
        computes too."""
        return self.loss_label, metrics["val_loss"]

    def masker(self, tokenizer_len: int, mask_id: int, special_ids, word_start) -> "SpanMasker":
        """Span masking of 15% of the words, n-grams up to `max_ngram`, 80/10/10 replacement (DeBERTa §3.2)."""
        from deberta.masking import SpanMasker

        c = self.cfg
        return SpanMasker(tokenizer_len, mask_id, special_ids, word_start, mlm_probability=c.mlm_probability,
                          max_ngram=c.max_ngram, seed=c.seed)

    def eval_inputs(self, mask_step: int) -> dict[str, Any]:
        """Extra model inputs of a validation batch (fixed across passes) besides ids, mask and labels."""
        return {}

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments that what is composed onto this objective adds to its model's constructor and to its
        FLOP count (`deberta.flops`): SOP's `sop=True`, the sentence-order head, which the model library places."""
        return {}

    # ------------------------------------------------------------------------------------------------- batch
    @property
    def model_inputs(self) -> dict[str, str]:
        """The model's inputs read from token-shard columns besides `input_ids`: {model keyword: column}."""
        return {}

    @property
    def shard_columns(self) -> tuple[str, ...]:
        """Columns of the token shards the loop reads."""
        return ("input_ids", *self.model_inputs.values())

    def batch(self, columns: Mapping[str, Any]) -> dict[str, "torch.Tensor"]:
        """Token-shard columns (numpy, rows of one micro-batch) -> the step's batch: "input_ids" (B, T) int64
        (uint32 on disk) and each of `model_inputs` as int64 ((B,) per row or (B, T) per token), by model keyword;
        the loop masks "input_ids" and hands the rest to the model as they are."""
        import numpy as np
        import torch

        wanted = {"input_ids": "input_ids", **self.model_inputs}
        return {key: torch.from_numpy(np.asarray(columns[column]).astype(np.int64)) for key, column in wanted.items()}

    # ----------------------------------------------------------------------------------------------- metrics
    def finish_step_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """Averaged step metrics as logged."""
        return means

    def step_line(self, metrics: dict[str, float]) -> str:
        """What the step's progress line shows after `loss`: each of `progress_metrics`."""
        return "".join(f" {k} {metrics[k]:.4f}" for k in self.progress_metrics)

    def eval_sums(self, outputs: Mapping[str, "torch.Tensor"]) -> Sums:
        """One validation batch's totals: MLM loss x targets, targets, correct predictions."""
        n = float(outputs["num_targets"])
        mlm = float(outputs["mlm_loss"] if "mlm_loss" in outputs else outputs["loss"])
        return {"mlm_loss_sum": mlm * n, "targets": n, "correct": float(outputs["correct"])}

    def eval_metrics(self, sums: Sums) -> dict[str, float]:
        """Validation numbers from the summed totals."""
        targets = max(sums["targets"], 1.0)
        mlm = sums["mlm_loss_sum"] / targets
        return {"val_loss": mlm, "val_accuracy": sums["correct"] / targets,
                "val_perplexity": math.exp(min(mlm, 50.0)), "val_targets": sums["targets"]}

    def eval_line(self, metrics: dict[str, float]) -> str:
        """What the validation progress line says after "validation": loss, accuracy and perplexity of the MLM."""
        return (f" loss {metrics['val_loss']:.4f} accuracy {metrics['val_accuracy']:.3f} "
                f"perplexity {metrics['val_perplexity']:.1f}")

    # ------------------------------------------------------------------------------------------------- plans
    def train_flops_per_token(self, model: "DebertaConfig", seq_len: int) -> float:
        raise NotImplementedError

    def activations(self, model: "DebertaConfig", shape: "Shape", checkpoint_every: int) -> "Activations":
        """What one micro-batch of this objective's step keeps for its backward pass (`deberta.activations`)."""
        raise NotImplementedError

    def parameter_counts(self, model: "DebertaConfig") -> dict[str, int]:
        """Parameters of the whole pretraining model (meta device) and of the backbone fine-tuning reads."""
        import torch

        from deberta.model import num_parameters

        factory, _ = self.build_model(model)
        with torch.device("meta"):
            whole = sum(p.numel() for p in factory().parameters())
        return {"total": whole, "backbone": num_parameters(model, "backbone")}

    def plan_line(self, model: "DebertaConfig", counts: dict[str, int], largest: int) -> str:
        """The dry run's parameter line."""
        raise NotImplementedError

    flops_note = ""
    """What the dry run's compute line adds (e.g. the generator's share)."""

    # ------------------------------------------------------------------------------------------------ export
    def backbone_weights(self, state_dict: dict) -> dict:
        """The tensors of the consolidated state dict a task head starts from, under `deberta.*` (what `model/`
        holds): the model's own here."""
        return state_dict

    def write_models(self, out: Path, model: "DebertaConfig", state_dict: dict, vocab_dir: Path) -> str:
        """The artifact's model directories from the consolidated state dict; returns a note on the exports."""
        raise NotImplementedError

    def export(self) -> Export:
        raise NotImplementedError
