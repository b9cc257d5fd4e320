"""DeBERTa model library: torch only (no Ray, DeepSpeed or MLflow; `transformers` only in `deberta.hf`).

    from deberta import DebertaConfig, DebertaForMaskedLM, SpanMasker, debug
"""

from deberta.config import DebertaConfig, debug, padded_vocab_size
from deberta.flops import train_flops_per_token
from deberta.masking import SpanMasker, word_starts_from_pieces
from deberta.model import DebertaForMaskedLM, DebertaForSequenceClassification, DebertaModel, num_parameters
from deberta.sift import sift_loss

__all__ = [
    "DebertaConfig",
    "DebertaForMaskedLM",
    "DebertaForSequenceClassification",
    "DebertaModel",
    "SpanMasker",
    "debug",
    "num_parameters",
    "padded_vocab_size",
    "sift_loss",
    "train_flops_per_token",
    "word_starts_from_pieces",
]
