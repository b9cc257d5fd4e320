"""What differs between the two pretraining objectives; everything else (data, engine, checkpoints) is shared.

  mlm  DeBERTa: `DebertaForMaskedLM` (EMD), whole-word span masking of 15% (n-grams up to `max_ngram`,
       80/10/10 replacement).
  rtd  DeBERTaV3 (seed 001): `deberta.rtd.RTDPretrainer` - a generator of half the depth trained with MLM, a
       discriminator trained on replaced-token detection, L = L_MLM + rtd_weight * L_RTD, embeddings shared as
       `embedding_sharing`. The generator's input follows the reference RTD task: single words, every target
       [MASK] (see deberta/rtd.py for why).

Generator and discriminator live in one module, so one DeepSpeed engine takes one optimizer step over both:
the stop-gradient of GDES routes each loss to its own tables (deberta/rtd.py), and one engine is one set of
ZeRO shards and one checkpoint; the reference's alternating two-trainer updates would need a table shared by
two engines, which ZeRO cannot partition twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from deberta.config import DebertaConfig
from deberta.masking import SpanMasker
from core.config import PretrainConfig

RTD_FILE = "rtd.json"
OBJECTIVE_METRICS = {"mlm": (), "rtd": ("mlm_loss", "rtd_loss", "rtd_accuracy", "replaced_fraction",
                                         "generator_accuracy")}


def step_metrics(cfg: PretrainConfig) -> tuple[str, ...]:
    """Per-step numbers accumulated besides `loss`, averaged over micro-batches and workers; SOP as its counts
    (`finish_metrics` turns them into its accuracy, so a micro-batch without a sentence pair weighs nothing)."""
    sop = ("mlm_loss", "sop_loss", "sop_correct", "sop_count") if cfg.sop else ()
    return tuple(dict.fromkeys((*OBJECTIVE_METRICS[cfg.objective], *sop)))


def step_values(out: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, float]:
    """The step metrics of one micro-batch from the model's outputs."""
    return {k: float(out[k].detach()) for k in keys}


def finish_metrics(means: dict[str, float]) -> dict[str, float]:
    """Averaged step metrics as logged: SOP's mean counts become `sop_accuracy` (correct over pairs seen)."""
    means = dict(means)
    if "sop_count" in means:
        correct, count = means.pop("sop_correct"), means.pop("sop_count")
        means["sop_accuracy"] = correct / count if count else float("nan")
    return means


def build_model(cfg: PretrainConfig, model: DebertaConfig) -> tuple[Callable[[], nn.Module],
                                                                      Callable[[nn.Module], None]]:
    """(model factory, per-module init for ZeRO-3's re-initialisation) of the objective."""
    if cfg.objective == "rtd":
        from deberta.rtd import RTDPretrainer, rtd_init_weights

        return (lambda: RTDPretrainer(model, generator_layers=cfg.generator_layers,
                                      embedding_sharing=cfg.embedding_sharing, rtd_weight=cfg.rtd_weight, sop=cfg.sop),
                lambda m: rtd_init_weights(m, model))
    from deberta.model import DebertaForMaskedLM, init_weights

    return lambda: DebertaForMaskedLM(model, sop=cfg.sop), lambda m: init_weights(m, model)


def make_masker(cfg: PretrainConfig, tokenizer_len: int, mask_id: int, special_ids, word_start) -> SpanMasker:
    if cfg.objective == "rtd":  # the reference RTD task: single words, every target [MASK]
        return SpanMasker(tokenizer_len, mask_id, special_ids, word_start, mlm_probability=cfg.mlm_probability,
                          max_ngram=1, seed=cfg.seed, mask_prob=1.0, random_prob=0.0)
    return SpanMasker(tokenizer_len, mask_id, special_ids, word_start, mlm_probability=cfg.mlm_probability,
                      max_ngram=cfg.max_ngram, seed=cfg.seed)


def eval_sums(cfg: PretrainConfig, out: dict[str, torch.Tensor]) -> list[float]:
    """One validation batch's sums (added over batches and workers, then turned into `eval_metrics`)."""
    n = float(out["num_targets"])
    mlm = float(out["mlm_loss"] if "mlm_loss" in out else out["loss"])
    sums = [mlm * n, n, float(out["generator_correct"] if cfg.objective == "rtd" else out["correct"])]
    if cfg.objective == "rtd":
        tokens = float(out["num_tokens"])
        sums += [float(out["rtd_loss"]) * tokens, tokens, float(out["rtd_correct"]), float(out["num_replaced"])]
    if cfg.sop:
        count = float(out["sop_count"])
        sums += [float(out["sop_loss"]) * count, count, float(out["sop_correct"])]
    return sums


def eval_metrics(cfg: PretrainConfig, sums: list[float]) -> dict[str, float]:
    loss_sum, targets, correct = sums[:3]
    mlm = loss_sum / max(targets, 1.0)
    metrics = {"val_loss": mlm, "val_accuracy": correct / max(targets, 1.0), "val_perplexity": math.exp(min(mlm, 50.0)),
               "val_targets": targets}
    rest = sums[3:]
    if cfg.objective == "rtd":
        (rtd_sum, tokens, rtd_correct, replaced), rest = rest[:4], rest[4:]
        rtd = rtd_sum / max(tokens, 1.0)
        metrics.update(val_loss=mlm + cfg.rtd_weight * rtd, val_mlm_loss=mlm, val_rtd_loss=rtd,
                       val_rtd_accuracy=rtd_correct / max(tokens, 1.0),
                       val_all_original_accuracy=1.0 - replaced / max(tokens, 1.0),
                       val_replaced_fraction=replaced / max(targets, 1.0))
    if cfg.sop:
        sop_sum, count, sop_correct = rest
        metrics.update(val_mlm_loss=mlm, val_sop_loss=sop_sum / max(count, 1.0),
                       val_sop_accuracy=sop_correct / max(count, 1.0), val_sop_pairs=count)
        metrics["val_loss"] += metrics["val_sop_loss"]
    return metrics


def train_flops_per_token(cfg: PretrainConfig, model: DebertaConfig, seq_len: int) -> float:
    from deberta import flops

    if cfg.objective == "rtd":
        from deberta.rtd import generator_config

        return flops.rtd_train_flops_per_token(model, seq_len, generator_config(model, cfg.generator_layers),
                                               target_fraction=cfg.mlm_probability, sop=cfg.sop)
    return flops.train_flops_per_token(model, seq_len, target_fraction=cfg.mlm_probability, sop=cfg.sop)


def parameter_counts(cfg: PretrainConfig, model: DebertaConfig) -> dict[str, int]:
    """Parameters of the whole pretraining model and of the backbone that is fine-tuned (meta device)."""
    from deberta.model import num_parameters

    factory, _ = build_model(cfg, model)
    with torch.device("meta"):
        whole = sum(p.numel() for p in factory().parameters())
    counts = {"total": whole, "backbone": num_parameters(model, "backbone")}
    if cfg.objective == "rtd":
        from deberta.rtd import generator_config

        counts["generator"] = num_parameters(generator_config(model, cfg.generator_layers), "mlm")
    return counts


def write_models(out: Path, cfg: PretrainConfig, model: DebertaConfig, state_dict: dict, vocab_dir: Path) -> str:
    """model/ (ours, what fine-tuning reads), hf/ (transformers, with the tokenizer) and for RTD rtd/ (both
    models, ours) and generator/ (the generator as HF `DebertaV2ForMaskedLM`). Returns a note on the exports."""
    from deberta import checkpoint, hf
    from deberta.model import DebertaForMaskedLM, DebertaModel, unshared_state_dict

    flat = model.replace(share_layers="none")  # HF has no shared layers: export the same model, weights copied out
    if cfg.objective != "rtd":
        checkpoint.save(state_dict, model, out / "model")
        if missing := checkpoint.load_into(DebertaForMaskedLM(model, sop=cfg.sop), out / "model"):
            raise RuntimeError(f"consolidated checkpoint lacks {missing}")
        mlm = DebertaForMaskedLM(flat)
        mlm.load_state_dict(unshared_state_dict(state_dict, model), strict=False)  # the SOP head stays ours
        hf.save_pretrained(mlm, out / "hf", vocab_dir=vocab_dir)
        return "hf/ DebertaV2ForMaskedLM" + (" (shared layers copied out)" if flat != model else "")
    from deberta.rtd import discriminator_weights, generator_config, generator_weights

    checkpoint.save(state_dict, model, out / "rtd")
    (out / "rtd" / RTD_FILE).write_text(json.dumps(
        {"embedding_sharing": cfg.embedding_sharing, "generator_layers": cfg.generator_layers,
         "rtd_weight": cfg.rtd_weight}, indent=2) + "\n")
    checkpoint.save(discriminator_weights(state_dict, cfg.embedding_sharing, with_head=True), model, out / "model")
    disc = DebertaModel(flat)
    disc.load_state_dict(unshared_state_dict(discriminator_weights(state_dict, cfg.embedding_sharing), model))
    hf.save_pretrained(disc, out / "hf", vocab_dir=vocab_dir)
    gen_cfg = generator_config(model, cfg.generator_layers)
    gen = DebertaForMaskedLM(gen_cfg.replace(share_layers="none"))
    gen.load_state_dict(unshared_state_dict(generator_weights(state_dict), gen_cfg))
    hf.save_pretrained(gen, out / "generator", vocab_dir=vocab_dir)
    return f"hf/ discriminator (DebertaV2Model, {cfg.embedding_sharing} embeddings merged), generator/ DebertaV2ForMaskedLM"


def objective_tags(cfg: PretrainConfig) -> dict[str, Any]:
    """Registry tags of the pretrained model version."""
    tags: dict[str, Any] = {"objective": cfg.objective, **({"sop": True} if cfg.sop else {})}
    if cfg.objective == "rtd":
        tags.update(embedding_sharing=cfg.embedding_sharing, rtd_weight=cfg.rtd_weight)
    return tags
