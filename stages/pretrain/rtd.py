"""DeBERTaV3's objective (DeBERTaV3 §2-3): replaced-token detection with a generator of half the depth (Table 10).

`deberta.rtd.RTDPretrainer`: the generator is trained with MLM, the discriminator on replaced-token detection,
L = L_MLM + rtd_weight * L_RTD, the word embeddings shared as `embedding_sharing` (DeBERTaV3 §3: "es" one table,
"nes" two, "gdes" E_D = sg(E_G) + E_delta). The generator's input follows the reference RTD task: single words,
every target [MASK] (deberta/rtd.py says why).

Generator and discriminator live in one module, so one DeepSpeed engine takes one optimizer step over both: the
stop-gradient of GDES routes each loss to its own tables, and one engine is one set of ZeRO shards and one
checkpoint; the reference's alternating two-trainer updates would need a table shared by two engines, which ZeRO
cannot partition twice.

Artifact: rtd/ (both models, ours, with rtd.json), model/ (the discriminator with its RTD head, embeddings
merged: what fine-tuning reads), hf/ (the discriminator as `DebertaV2Model`), generator/ (the generator as
`DebertaV2ForMaskedLM`); registered as a feature-extraction MLflow Model, generator/ a run artifact beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from core.config import ConfigError
from stages.pretrain.objective import Export, Objective, Sums

if TYPE_CHECKING:
    import torch
    from torch import nn

    from core.init_checkpoint import ExternalCheckpoint
    from deberta.activations import Activations, Shape
    from deberta.config import DebertaConfig
    from deberta.masking import SpanMasker

RTD_FILE = "rtd.json"
"""Beside rtd/'s checkpoint: embedding sharing, generator depth and lambda."""


class RTD(Objective):
    name = "rtd"
    step_metrics = ("mlm_loss", "rtd_loss", "rtd_accuracy", "replaced_fraction", "generator_accuracy")
    progress_metrics = ("mlm_loss", "rtd_loss", "rtd_accuracy")
    flops_note = ", generator included"
    final_metrics = (*Objective.final_metrics, "val_rtd_loss", "val_rtd_accuracy", "val_all_original_accuracy",
                     "val_replaced_fraction")

    @property
    def loss_terms(self) -> tuple[str, ...]:
        """L = L_MLM (the generator's) + lambda L_RTD (DeBERTaV3 §2.3)."""
        return "generator MLM", f"{self.cfg.rtd_weight:g} x RTD"

    def check(self, model: DebertaConfig) -> list[str]:
        """lambda, the embedding sharing, the generator's depth; `generator_init` only beside `init`."""
        from deberta.config import EMBEDDING_SHARING

        c, problems = self.cfg, []
        if c.embedding_sharing not in EMBEDDING_SHARING:
            problems.append(f"pretrain.embedding_sharing={c.embedding_sharing!r}: use gdes, es or nes")
        if not c.rtd_weight > 0:
            problems.append(f"pretrain.rtd_weight={c.rtd_weight}: must be > 0 (DeBERTaV3 uses 50)")
        layers = c.generator_layers
        if layers is not None and layers < 1:
            problems.append(f"pretrain.generator_layers={layers}: must be >= 1 (or none for half the depth)")
        elif layers is not None and layers > model.num_hidden_layers:
            problems.append(f"pretrain.generator_layers={layers} is deeper than the discriminator "
                            f"(model.num_hidden_layers={model.num_hidden_layers}); DeBERTaV3 uses half the depth "
                            f"(generator_layers=none)")
        if c.generator_init and not c.init:
            problems.append(f"pretrain.generator_init={c.generator_init}: a generator is only read when continuing "
                            f"pretraining; set pretrain.init=DIR (or drop generator_init)")
        return problems

    def continued_config(self, released: DebertaConfig, init: str, generator: ExternalCheckpoint | None
                         ) -> dict[str, Any]:
        """The generator's depth: the given generator's (checked to be the discriminator's model at another depth,
        with its tokenizer), else that of the authors' pytorch_model.generator.bin beside `init`, else the setting."""
        from deberta import continue_from

        c = self.cfg
        try:
            found = (continue_from.check_generator(generator.config(), released, generator.path, init) if generator
                     else continue_from.generator_bin_layers(init, released))
        except ValueError as e:
            where = c.generator_init or f"(none; {continue_from.AUTHORS_GENERATOR_FILE} beside pretrain.init)"
            raise ConfigError(f"pretrain.generator_init={where}: {e}") from None
        if found is not None and c.generator_layers is not None and c.generator_layers != found:
            raise ConfigError(f"pretrain.generator_layers={c.generator_layers} contradicts the generator to start "
                              f"from ({found} layers); drop the --set")
        return {"generator_layers": found if found is not None else c.generator_layers}

    def build_model(self, model: "DebertaConfig") -> tuple[Callable[[], "nn.Module"], Callable[["nn.Module"], None]]:
        from deberta.rtd import RTDPretrainer, rtd_init_weights

        c = self.cfg
        return (lambda: RTDPretrainer(model, generator_layers=c.generator_layers, embedding_sharing=c.embedding_sharing,
                                      rtd_weight=c.rtd_weight, emd=c.emd, **self.model_options()),
                lambda m: rtd_init_weights(m, model))

    def initial_weights(self, model: "DebertaConfig", init: str, generator_init: str = ""
                        ) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
        """The discriminator from `init`; the generator from `generator_init`, else the authors'
        pytorch_model.generator.bin beside it, else derived from the discriminator (`deberta.continue_from`)."""
        from deberta import continue_from

        c, layers = self.cfg, self.generator_config(model).num_hidden_layers
        gen_cfg = self.generator_config(model)
        generator = (continue_from.read(generator_init, gen_cfg) if generator_init
                     else continue_from.read_generator(init, model, layers))
        return continue_from.rtd_weights(continue_from.read(init, model), generator, layers, c.embedding_sharing,
                                         c.emd)

    def masker(self, tokenizer_len: int, mask_id: int, special_ids, word_start) -> "SpanMasker":
        """The reference RTD task: single words, every target [MASK]."""
        from deberta.masking import SpanMasker

        c = self.cfg
        return SpanMasker(tokenizer_len, mask_id, special_ids, word_start, mlm_probability=c.mlm_probability,
                          max_ngram=1, seed=c.seed, mask_prob=1.0, random_prob=0.0)

    def eval_inputs(self, mask_step: int) -> dict[str, Any]:
        """The generator's samples seeded by the mask step: the same replacements at every validation pass."""
        return {"generator": mask_step}

    def eval_sums(self, outputs: Mapping[str, "torch.Tensor"]) -> Sums:
        n, tokens = float(outputs["num_targets"]), float(outputs["num_tokens"])
        return {"mlm_loss_sum": float(outputs["mlm_loss"]) * n, "targets": n, "correct": float(outputs["generator_correct"]),
                "rtd_loss_sum": float(outputs["rtd_loss"]) * tokens, "tokens": tokens,
                "rtd_correct": float(outputs["rtd_correct"]), "replaced": float(outputs["num_replaced"])}

    def eval_metrics(self, sums: Sums) -> dict[str, float]:
        metrics = super().eval_metrics(sums)
        mlm, tokens = metrics["val_loss"], max(sums["tokens"], 1.0)
        rtd = sums["rtd_loss_sum"] / tokens
        metrics.update(val_loss=mlm + self.cfg.rtd_weight * rtd, val_mlm_loss=mlm, val_rtd_loss=rtd,
                       val_rtd_accuracy=sums["rtd_correct"] / tokens,
                       val_all_original_accuracy=1.0 - sums["replaced"] / tokens,
                       val_replaced_fraction=sums["replaced"] / max(sums["targets"], 1.0))
        return metrics

    def eval_line(self, metrics: dict[str, float]) -> str:
        return (super().eval_line(metrics) + f" RTD accuracy {metrics['val_rtd_accuracy']:.3f} (all-original "
                f"{metrics['val_all_original_accuracy']:.3f})")

    def activations(self, model: "DebertaConfig", shape: "Shape", checkpoint_every: int) -> "Activations":
        from deberta.activations import rtd_activations

        return rtd_activations(model, self.generator_config(model), shape, checkpoint_every, self.cfg.mlm_probability,
                               self.cfg.emd)

    def generator_config(self, model: "DebertaConfig") -> "DebertaConfig":
        from deberta.rtd import generator_config

        return generator_config(model, self.cfg.generator_layers)

    def train_flops_per_token(self, model: "DebertaConfig", seq_len: int) -> float:
        from deberta import flops

        return flops.rtd_train_flops_per_token(model, seq_len, self.generator_config(model),
                                               target_fraction=self.cfg.mlm_probability, **self.model_options())

    def parameter_counts(self, model: "DebertaConfig") -> dict[str, int]:
        from deberta.model import num_parameters

        return {**super().parameter_counts(model), "generator": num_parameters(self.generator_config(model), "mlm")}

    def plan_line(self, model: "DebertaConfig", counts: dict[str, int], largest: int) -> str:
        return (f"  parameters: {counts['total']:,} (RTD: generator {counts['generator']:,} of "
                f"{self.generator_config(model).num_hidden_layers} layers + discriminator; backbone "
                f"{counts['backbone']:,}; embeddings {self.cfg.embedding_sharing}); largest layer {largest:,}")

    def backbone_weights(self, state_dict: dict) -> dict:
        """The discriminator's, its embeddings merged (what fine-tuning reads from model/)."""
        from deberta import checkpoint
        from deberta.rtd import discriminator_weights

        weights = discriminator_weights(state_dict, self.cfg.embedding_sharing)
        return {f"{checkpoint.BACKBONE_PREFIX}{k}": v for k, v in weights.items()}

    def write_models(self, out: Path, model: "DebertaConfig", state_dict: dict, vocab_dir: Path) -> str:
        """rtd/ (both models, ours), model/ (the discriminator, ours), hf/ and generator/ (transformers)."""
        from deberta import checkpoint, hf
        from deberta.model import DebertaForMaskedLM, DebertaModel, unshared_state_dict
        from deberta.rtd import discriminator_weights, generator_weights

        c = self.cfg
        checkpoint.save(state_dict, model, out / "rtd")
        (out / "rtd" / RTD_FILE).write_text(json.dumps(
            {"embedding_sharing": c.embedding_sharing, "generator_layers": c.generator_layers,
             "rtd_weight": c.rtd_weight}, indent=2) + "\n")
        checkpoint.save(discriminator_weights(state_dict, c.embedding_sharing, with_head=True), model, out / "model")
        disc = DebertaModel(model.replace(share_layers="none"))  # HF has no shared layers: weights copied out
        disc.load_state_dict(unshared_state_dict(discriminator_weights(state_dict, c.embedding_sharing), model))
        hf.save_pretrained(disc, out / "hf", vocab_dir=vocab_dir)
        gen_cfg = self.generator_config(model)
        gen = DebertaForMaskedLM(gen_cfg.replace(share_layers="none"), emd=c.emd)
        gen.load_state_dict(unshared_state_dict(generator_weights(state_dict), gen_cfg))
        hf.save_pretrained(gen, out / "generator", vocab_dir=vocab_dir)
        return (f"hf/ discriminator (DebertaV2Model, {c.embedding_sharing} embeddings merged), "
                f"generator/ DebertaV2ForMaskedLM")

    def export(self) -> Export:
        c = self.cfg
        return Export(description=f"DeBERTaV3 RTD discriminator ({c.embedding_sharing})", task="feature-extraction",
                      example="The president said on Monday that he would resign.", extra_dirs=("generator",),
                      tags={"objective": self.name, "embedding_sharing": c.embedding_sharing,
                            "rtd_weight": c.rtd_weight})
