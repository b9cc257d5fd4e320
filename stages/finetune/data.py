"""Fine-tuning inputs: the task's splits as token arrays, and the pretrained checkpoint they start from.

Encoding is numpy only (the driver tokenises once and ships the arrays to every trial); reading the pretrained
weights imports torch, lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.artifacts import Artifact
from core.tokenizer import MODEL_FILE, Tokenizer
from core.errors import StageInputError
from core.init_checkpoint import ExternalCheckpoint

if TYPE_CHECKING:
    import torch

    from deberta.config import DebertaConfig
    from core.config import FinetuneConfig
    from stages.finetune.tasks import Split, TaskRef

# architecture fields that must agree between the run's model config and the pretrained checkpoint
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "position_buckets", "max_relative_positions", "share_att_key",
                "conv_kernel_size")


@dataclass(frozen=True)
class Encoded:
    """A tokenised split: [CLS] a [SEP] (b [SEP]) right-padded with [PAD]=0."""

    ids: np.ndarray  # (N, T) int32
    label: np.ndarray  # (N,) float32: class id or regression target

    def __len__(self) -> int:
        return len(self.label)


def _truncate_pair(a: list[int], b: list[int] | None, budget: int) -> tuple[list[int], list[int] | None]:
    """Longest-first truncation (as HF tokenizers) until both fit in `budget` pieces."""
    if b is None:
        return a[:budget], None
    la, lb = len(a), len(b)
    while la + lb > budget:
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


def encode_split(tok: Tokenizer, split: "Split", max_len: int) -> Encoded:
    a_ids = tok.encode(split.text_a, num_threads=1)
    b_ids = tok.encode(split.text_b, num_threads=1) if split.text_b is not None else [None] * len(a_ids)
    ids = np.full((len(a_ids), max_len), tok.pad_id, dtype=np.int32)
    for i, (a, b) in enumerate(zip(a_ids, b_ids)):
        a, b = _truncate_pair(a, b, max_len - (2 if b is None else 3))
        row = [tok.cls_id, *a, tok.sep_id] + ([] if b is None else [*b, tok.sep_id])
        ids[i, :len(row)] = row
    return Encoded(ids, np.asarray(split.label, dtype=np.float32))


def prepare_data(task: "TaskRef", tok: Tokenizer, cfg: "FinetuneConfig") -> tuple[Encoded, Encoded]:
    """(train, dev) arrays; train capped at `max_train_examples` by a fixed-seed sample."""
    train = encode_split(tok, task.train, cfg.max_seq_len)
    if cfg.max_train_examples is not None and len(train) > cfg.max_train_examples:
        keep = np.sort(np.random.default_rng(0).permutation(len(train))[:cfg.max_train_examples])
        train = Encoded(train.ids[keep], train.label[keep])
    return train, encode_split(tok, task.dev, cfg.max_seq_len)


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
