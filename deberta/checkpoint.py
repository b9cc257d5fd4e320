"""Our own checkpoint format: a directory with `config.json` and `model.pt` (torch only).

    config.json   DebertaConfig.to_dict()
    model.pt      torch.save of a DebertaForMaskedLM state_dict, fp32, on CPU

The pretraining stage writes it (with the EMD's absolute position table, which the HF export cannot
carry); fine-tuning loads its backbone into a classifier with `load_into`, whose head stays freshly
initialised. Parameter names are HF's (`deberta.*`, `lm_predictions.*`), so this is also what
`deberta.hf` copies from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from deberta.config import DebertaConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pt"
BACKBONE_PREFIX = "deberta."


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, unreadable or does not fit the model; the message says which."""


def save(model: nn.Module | Mapping[str, torch.Tensor], cfg: DebertaConfig, directory: Path | str) -> Path:
    """Write `cfg` and the fp32 CPU state dict of `model` (a module or a state dict) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict() if isinstance(model, nn.Module) else model
    fp32 = {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
            for k, v in state.items()}
    (directory / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    torch.save(fp32, directory / WEIGHTS_FILE)
    return directory


def load_config(directory: Path | str) -> DebertaConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {directory}; point at a model directory written by "
                              f"deberta.checkpoint.save (the pretrain artifact's model/ folder)")
    try:
        return DebertaConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a DebertaConfig: {e}") from None


def load_state_dict(directory: Path | str) -> dict[str, torch.Tensor]:
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"no {WEIGHTS_FILE} in {directory}; point at a model directory written by "
                              f"deberta.checkpoint.save (the pretrain artifact's model/ folder)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); re-create the checkpoint") from None


def _few(keys: list[str], n: int = 5) -> str:
    return str(keys[:n]) + ("..." if len(keys) > n else "")


def _shape_mismatches(src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], keys) -> list[str]:
    return [f"{k}: checkpoint {tuple(src[k].shape)} vs model {tuple(dst[k].shape)}"
            for k in sorted(keys) if src[k].shape != dst[k].shape]


def load_into(model: nn.Module, directory: Path | str) -> list[str]:
    """Load a checkpoint into a DebertaForMaskedLM or DebertaForSequenceClassification.

    The backbone (`deberta.*`) must match exactly, key for key and shape for shape, or CheckpointError
    names the differences. Head tensors present in both with equal shapes are loaded too (an MLM into an
    MLM loads everything). Returns the model's keys left untouched: the heads to train from scratch.
    """
    state = load_state_dict(directory)
    own = model.state_dict()
    ckpt_backbone = {k for k in state if k.startswith(BACKBONE_PREFIX)}
    model_backbone = {k for k in own if k.startswith(BACKBONE_PREFIX)}
    if not model_backbone:
        raise CheckpointError(f"{type(model).__name__} has no '{BACKBONE_PREFIX}*' parameters; load_into expects a "
                              f"DebertaForMaskedLM or DebertaForSequenceClassification")
    problems = []
    if ckpt_backbone != model_backbone:
        only_ckpt, only_model = sorted(ckpt_backbone - model_backbone), sorted(model_backbone - ckpt_backbone)
        problems.append(f"backbone keys differ: only in checkpoint {_few(only_ckpt)}, only in model {_few(only_model)}")
    problems += _shape_mismatches(state, own, ckpt_backbone & model_backbone)
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not fit {type(model).__name__}: " + "; ".join(problems[:6])
            + f". Build the model from deberta.checkpoint.load_config({str(directory)!r}) instead of another config")
    heads = {k for k in own if k not in model_backbone and k in state and state[k].shape == own[k].shape}
    loadable = {k: state[k] for k in model_backbone | heads}
    missing, unexpected = model.load_state_dict(loadable, strict=False)
    assert not unexpected, unexpected  # loadable only holds the model's own keys
    return sorted(missing)
