"""Fine-tuning inputs: the task's splits as token arrays (by its kind, `stages.finetune.kinds`), and the
pretrained checkpoint they start from.

Encoding is numpy only (the driver tokenises once and ships the arrays to every trial); reading the pretrained
weights imports torch, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.artifacts import Artifact
from core.tokenizer import MODEL_FILE
from core.errors import StageInputError
from core.init_checkpoint import ExternalCheckpoint
from stages.finetune.kinds.base import Encoded

if TYPE_CHECKING:
    import torch

    from deberta.config import DebertaConfig
    from core.config import FinetuneConfig
    from stages.finetune.kinds.base import TaskRef

# architecture fields that must agree between the run's model config and the pretrained checkpoint
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "position_buckets", "max_relative_positions", "share_att_key",
                "conv_kernel_size")


def prepare_data(task: "TaskRef", tok_dir: Path, cfg: "FinetuneConfig") -> tuple[Encoded, Encoded]:
    """(train, dev) rows by the task's kind (`tok_dir`: the checkpoint's vocabulary); train capped at
    `max_train_examples` rows by a fixed-seed sample."""
    kind = task.kind
    train = kind.encode(task, task.train, tok_dir, cfg)
    if cfg.max_train_examples is not None and len(train) > cfg.max_train_examples:
        train = train.take(np.sort(np.random.default_rng(0).permutation(len(train))[:cfg.max_train_examples]))
    return train, kind.encode(task, task.dev, tok_dir, cfg)


INIT_KEY = "finetune.init"


def pretrained_dirs(inputs: dict[str, Any], model: "DebertaConfig") -> tuple[Path, Path]:
    """(checkpoint dir, tokenizer dir) of the pretrained artifact, checked against the run's model config."""
    from deberta import checkpoint

    art = inputs.get("pretrain")
    if art is None:
        raise StageInputError("finetune needs the pretrained checkpoint (input 'pretrain'); run the pipeline "
                              "with --until pretrain first")
    root = Path(art.path if isinstance(art, Artifact) else art)
    ckpt_dir = root / "model"
    if not (ckpt_dir / checkpoint.WEIGHTS_FILE).is_file() or not (ckpt_dir / checkpoint.CONFIG_FILE).is_file():
        raise StageInputError(f"pretrained artifact {root} is missing model/model.pt or model/config.json; "
                              f"re-run with --force pretrain to rebuild it")
    try:
        saved = checkpoint.load_config(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise StageInputError(str(e)) from None
    diff = [f for f in SHAPE_FIELDS if getattr(saved, f) != getattr(model, f)]
    if diff:
        raise StageInputError(f"pretrained artifact {root} was built for another model ({', '.join(diff)} differ "
                              f"from the [model] section); use the preset it was pretrained with")
    for tok_dir in (root / "tokenizer", Path(getattr(inputs.get("vocab"), "path", root / "tokenizer"))):
        if (tok_dir / MODEL_FILE).is_file():
            return ckpt_dir, tok_dir
    raise StageInputError(f"no SentencePiece model in {root / 'tokenizer'} or the vocab artifact; "
                          f"re-run with --force pretrain")


def backbone_weights(ckpt_dir: Path) -> dict[str, "torch.Tensor"]:
    """The `deberta.*` tensors of the pretrained model (its LM or RTD head and EMD stay behind)."""
    from deberta import checkpoint

    try:
        state = checkpoint.load_state_dict(ckpt_dir)
    except checkpoint.CheckpointError as e:
        raise StageInputError(str(e)) from None
    return {k: v for k, v in state.items() if k.startswith(checkpoint.BACKBONE_PREFIX)}


def load_pretrained(inputs: dict[str, Any], model: "DebertaConfig", scratch: Path) -> tuple[Path, dict[str, "torch.Tensor"]]:
    """(tokenizer directory, backbone weights) to fine-tune from: the pretrain artifact, or an external HF
    checkpoint (`deberta.hf.load_backbone` reads it field by field; its spm.model becomes our tokenizer layout)."""
    art = inputs.get("pretrain")
    if isinstance(art, ExternalCheckpoint):
        from deberta import hf

        try:
            imported = hf.load_backbone(art.path)
            return imported.write_vocab(scratch / "tokenizer"), imported.state_dict
        except (ValueError, FileNotFoundError) as e:
            raise StageInputError(f"{INIT_KEY}={art.source}: {e}") from None
    ckpt_dir, tok_dir = pretrained_dirs(inputs, model)
    return tok_dir, backbone_weights(ckpt_dir)
