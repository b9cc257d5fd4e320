"""DeBERTa model library: torch only (no Ray, DeepSpeed or MLflow; `transformers` only in `deberta.hf`).

    from deberta import DebertaConfig, DebertaForMaskedLM, SpanMasker, debug

The names below load on first use (PEP 562 module `__getattr__`), so that `deberta.config` (the pipeline's
[model] section) is read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "DebertaConfig": "deberta.config",
    "debug": "deberta.config",
    "padded_vocab_size": "deberta.config",
    "train_flops_per_token": "deberta.flops",
    "SpanMasker": "deberta.masking",
    "word_starts_from_pieces": "deberta.masking",
    "DebertaForMaskedLM": "deberta.model",
    "DebertaForSequenceClassification": "deberta.heads",
    "DebertaForTokenClassification": "deberta.heads",
    "DebertaForQuestionAnswering": "deberta.heads",
    "DebertaModel": "deberta.model",
    "num_parameters": "deberta.model",
    "sift_loss": "deberta.sift",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'deberta' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
