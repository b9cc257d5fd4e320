"""DeBERTa's objective (DeBERTa §3.2-3.3): `DebertaForMaskedLM` with the enhanced mask decoder, whole-word span
masking of 15% of the words (n-grams up to `max_ngram`, 80/10/10 replacement).

Artifact: model/ (ours, the EMD table included: what fine-tuning reads) and hf/ (transformers
`DebertaV2ForMaskedLM`: backbone and LM head, without the EMD, whose HF counterpart does not exist); registered as
a fill-mask MLflow Model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from stages.pretrain.objective import Export, Objective
from stages.tokenize import DOC_INDEX_COLUMN

if TYPE_CHECKING:
    import torch
    from torch import nn

    from deberta.activations import Activations, Shape
    from deberta.config import DebertaConfig


class MLM(Objective):
    name = "mlm"
    loss_terms = ("MLM",)
    reads_documents = True

    @property
    def model_inputs(self) -> dict[str, str]:
        """pretrain.document_mask: each token's document within its packed row (B, T), attention kept inside it."""
        return {"document_ids": DOC_INDEX_COLUMN} if self.cfg.document_mask else {}

    def build_model(self, model: "DebertaConfig") -> tuple[Callable[[], "nn.Module"], Callable[["nn.Module"], None]]:
        from deberta.model import DebertaForMaskedLM, init_weights

        options = {"emd": self.cfg.emd, **self.model_options()}
        return lambda: DebertaForMaskedLM(model, **options), lambda m: init_weights(m, model)

    def initial_weights(self, model: "DebertaConfig", init: str, generator_init: str = ""
                        ) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
        from deberta import continue_from

        return continue_from.mlm_weights(continue_from.read(init, model), self.cfg.emd)

    def released_loss_inputs(self) -> dict[str, Any] | None:
        """HF's DebertaV2ForMaskedLM: the head on the backbone's last layer, no EMD."""
        return {"use_emd": False}

    def released_loss(self, metrics: dict[str, float]) -> tuple[str, float]:
        """The MLM term alone (a head composed on top is new to the checkpoint)."""
        return "MLM loss", metrics.get("val_mlm_loss", metrics["val_loss"])

    def train_flops_per_token(self, model: "DebertaConfig", seq_len: int) -> float:
        from deberta import flops

        return flops.train_flops_per_token(model, seq_len, target_fraction=self.cfg.mlm_probability,
                                           **self.model_options())

    def activations(self, model: "DebertaConfig", shape: "Shape", checkpoint_every: int) -> "Activations":
        from deberta.activations import mlm_activations

        return mlm_activations(model, shape, checkpoint_every, self.cfg.mlm_probability, self.cfg.emd)

    def plan_line(self, model: "DebertaConfig", counts: dict[str, int], largest: int) -> str:
        return (f"  parameters: {counts['total']:,} (MLM with EMD position table; backbone {counts['backbone']:,}); "
                f"largest layer {largest:,}")

    def write_models(self, out: Path, model: "DebertaConfig", state_dict: dict, vocab_dir: Path) -> str:
        """model/ (ours) and hf/ (transformers, with the tokenizer; a head composed on top stays ours)."""
        from deberta import checkpoint, hf
        from deberta.model import DebertaForMaskedLM, unshared_state_dict

        checkpoint.save(state_dict, model, out / "model")
        whole = DebertaForMaskedLM(model, emd=self.cfg.emd, **self.model_options())
        if missing := checkpoint.load_into(whole, out / "model"):
            raise RuntimeError(f"consolidated checkpoint lacks {missing}")
        flat = model.replace(share_layers="none")  # HF has no shared layers: the same model, weights copied out
        mlm = DebertaForMaskedLM(flat)
        mlm.load_state_dict(unshared_state_dict(state_dict, model), strict=False)
        hf.save_pretrained(mlm, out / "hf", vocab_dir=vocab_dir)
        return "hf/ DebertaV2ForMaskedLM" + (" (shared layers copied out)" if flat != model else "")

    def export(self) -> Export:
        return Export(description="DeBERTa MLM" + ("+EMD" if self.cfg.emd else " (no EMD)"), task="fill-mask",
                      example="The president said on [MASK] that he would resign.", tags={"objective": self.name})
