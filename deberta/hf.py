"""Import from / export to HF `transformers` DeBERTa-v2 (`DebertaV2Model`, `DebertaV2ForMaskedLM` with
`legacy=False`, `DebertaV2ForSequenceClassification`).

Our parameter names are HF's, so conversion is a state-dict copy; the only keys that differ are ours
alone: the EMD's absolute position table (`emd.position_embeddings`), which HF has no place for. It is
dropped on export (an exported MLM carries backbone + LM head) and freshly initialised on import.

`transformers` is imported lazily, inside these functions: the rest of `deberta/` needs torch only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from deberta.config import DebertaConfig
from deberta.model import DebertaForMaskedLM, DebertaForSequenceClassification, DebertaModel

# Keys that exist only in our models (HF has no EMD).
OURS_ONLY_PREFIXES = ("emd.",)
# HF settings our architecture fixes (SPEC.md "HF interop"): anything else cannot be imported faithfully.
_FIXED = {
    "relative_attention": True,
    "position_biased_input": False,
    "hidden_act": "gelu",
    "type_vocab_size": 0,
}


def to_hf_config(cfg: DebertaConfig, **extra: Any):
    """Our config -> `transformers.DebertaV2Config` (HF defaults differ from ours: every knob is set)."""
    from transformers import DebertaV2Config

    return DebertaV2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        layer_norm_eps=cfg.layer_norm_eps,
        max_relative_positions=cfg.max_relative_positions,
        pad_token_id=cfg.pad_token_id,
        pos_att_type=["p2c", "c2p"],
        position_buckets=cfg.position_buckets if cfg.position_buckets > 0 else -1,
        share_att_key=cfg.share_att_key,
        norm_rel_ebd="layer_norm" if cfg.norm_rel_ebd else "none",
        conv_kernel_size=cfg.conv_kernel_size,
        conv_act="gelu",
        legacy=False,
        **_FIXED,
        **extra,
    )


def from_hf_config(hf_cfg) -> DebertaConfig:
    """`transformers.DebertaV2Config` -> our config; refuses features our model does not implement."""
    for key, want in _FIXED.items():
        got = getattr(hf_cfg, key, None)
        if got != want:
            raise ValueError(f"from_transformers: config.{key}={got!r} is not supported (need {want!r})")
    pos_att = set(getattr(hf_cfg, "pos_att_type", None) or [])
    if pos_att != {"p2c", "c2p"}:
        raise ValueError(f"from_transformers: pos_att_type={sorted(pos_att)} is not supported (need ['c2p', 'p2c'])")
    if getattr(hf_cfg, "embedding_size", hf_cfg.hidden_size) != hf_cfg.hidden_size:
        raise ValueError("from_transformers: embedding_size != hidden_size (embed_proj) is not supported")
    conv = getattr(hf_cfg, "conv_kernel_size", 0)
    if conv > 0 and getattr(hf_cfg, "conv_act", "tanh") != "gelu":
        raise ValueError(f"from_transformers: conv_act={hf_cfg.conv_act!r} is not supported (need 'gelu')")
    if conv > 0 and getattr(hf_cfg, "conv_groups", 1) != 1:
        raise ValueError("from_transformers: conv_groups != 1 is not supported")
    norm = [x.strip() for x in str(getattr(hf_cfg, "norm_rel_ebd", "none")).lower().split("|")]
    buckets = getattr(hf_cfg, "position_buckets", -1)
    return DebertaConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        num_hidden_layers=hf_cfg.num_hidden_layers,
        num_attention_heads=hf_cfg.num_attention_heads,
        intermediate_size=hf_cfg.intermediate_size,
        hidden_dropout_prob=hf_cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=hf_cfg.attention_probs_dropout_prob,
        max_position_embeddings=hf_cfg.max_position_embeddings,
        position_buckets=buckets if buckets > 0 else 0,
        max_relative_positions=getattr(hf_cfg, "max_relative_positions", -1),
        share_att_key=bool(getattr(hf_cfg, "share_att_key", False)),
        conv_kernel_size=conv,
        norm_rel_ebd="layer_norm" in norm,
        layer_norm_eps=hf_cfg.layer_norm_eps,
        pad_token_id=hf_cfg.pad_token_id if hf_cfg.pad_token_id is not None else 0,
        initializer_range=hf_cfg.initializer_range,
    )


def _copy_state(src: dict[str, torch.Tensor], dst: nn.Module, skip_missing: tuple[str, ...]) -> None:
    """Copy every tensor of `src` into `dst` by name; every dst key must be covered except `skip_missing`."""
    dst_state = dst.state_dict()
    missing = [k for k in dst_state if k not in src and not k.startswith(skip_missing)]
    if missing:
        raise ValueError(f"checkpoint conversion: missing parameters {missing[:8]} (of {len(missing)})")
    with torch.no_grad():
        for name, tensor in dst_state.items():
            if name in src:
                if src[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint conversion: {name} has shape {tuple(src[name].shape)}, "
                                     f"expected {tuple(tensor.shape)}")
                tensor.copy_(src[name])


def _hf_state(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    # HF's non-persistent `position_ids` buffer has no counterpart in ours (we hold no absolute table)
    return {k: v for k, v in hf_model.state_dict().items() if not k.endswith("position_ids")}


def from_transformers(hf_model: nn.Module) -> nn.Module:
    """HF DebertaV2Model / DebertaV2ForMaskedLM(legacy=False) / DebertaV2ForSequenceClassification -> ours.

    An imported MLM gets a freshly initialised EMD position table (HF checkpoints have none).
    """
    name = type(hf_model).__name__
    cfg = from_hf_config(hf_model.config)
    state = _hf_state(hf_model)
    if name == "DebertaV2Model":
        model: nn.Module = DebertaModel(cfg)
        _copy_state(state, model, ())
    elif name == "DebertaV2ForMaskedLM":
        if hf_model.config.legacy:
            raise ValueError("from_transformers: legacy=True MLM heads (cls.predictions.*) are not supported; "
                             "use DebertaV2ForMaskedLM with legacy=False")
        model = DebertaForMaskedLM(cfg)
        _copy_state(state, model, OURS_ONLY_PREFIXES)
    elif name == "DebertaV2ForSequenceClassification":
        hc = hf_model.config
        cls_dropout = getattr(hc, "cls_dropout", None)
        model = DebertaForSequenceClassification(
            cfg,
            num_labels=hc.num_labels,
            classifier_dropout=hc.hidden_dropout_prob if cls_dropout is None else cls_dropout,
            pooler_dropout=hc.pooler_dropout,
        )
        _copy_state(state, model, ())
    else:
        raise TypeError(f"from_transformers: unsupported model class {name}")
    return model


def to_transformers(model: nn.Module) -> nn.Module:
    """Ours -> the matching HF model (eval-ready copy). The EMD position table is not exported."""
    import transformers as tf

    if isinstance(model, DebertaForSequenceClassification):
        hf_cfg = to_hf_config(
            model.cfg,
            num_labels=model.num_labels,
            cls_dropout=model.classifier_dropout,
            pooler_dropout=model.pooler_dropout,
        )
        hf_model = tf.DebertaV2ForSequenceClassification(hf_cfg)
        if model.deberta.embeddings.sift:
            raise ValueError("to_transformers: a sift=True model normalises embeddings; HF cannot represent that")
    elif isinstance(model, DebertaForMaskedLM):
        hf_model = tf.DebertaV2ForMaskedLM(to_hf_config(model.cfg))
    elif isinstance(model, DebertaModel):
        hf_model = tf.DebertaV2Model(to_hf_config(model.cfg))
    else:
        raise TypeError(f"to_transformers: unsupported model class {type(model).__name__}")
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith(OURS_ONLY_PREFIXES)}
    _copy_state(ours, hf_model, ())
    return hf_model.eval()


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    """Write an HF directory (config.json + safetensors) that `transformers.AutoModel.from_pretrained`
    loads (and `AutoModelForMaskedLM` / `AutoModelForSequenceClassification` for the task models)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    to_transformers(model).save_pretrained(path)
    return path
