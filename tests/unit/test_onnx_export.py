"""ONNX exports of the fine-tuned heads answer as transformers' torch model does (deberta/onnx_export.py), at
batch sizes and lengths other than the traced one, with padding; what has no task is refused. Tiny random models:
the check is the export's fidelity, not what the model learned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deberta import hf, onnx_export
from deberta.config import debug
from deberta.heads import (DebertaForMultipleChoice, DebertaForQuestionAnswering, DebertaForSequenceClassification,
                           DebertaForTokenClassification)
from deberta.model import DebertaForMaskedLM

CFG = debug(vocab_size=200, num_hidden_layers=2)
HEADS = {"sequence": lambda: DebertaForSequenceClassification(CFG, num_labels=3, classifier_dropout=0.1),
         "token": lambda: DebertaForTokenClassification(CFG, num_labels=5, classifier_dropout=0.1),
         "span": lambda: DebertaForQuestionAnswering(CFG, classifier_dropout=0.1),
         "choice": lambda: DebertaForMultipleChoice(CFG, classifier_dropout=0.1)}


def _saved(model: torch.nn.Module, path) -> str:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.to_transformers(model.eval()).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", list(HEADS))
def test_onnx_logits_equal_torch(kind, tmp_path):
    hf_dir = _saved(HEADS[kind](), tmp_path / "hf")
    onnx_path = onnx_export.export(hf_dir, tmp_path / "onnx")
    rng = np.random.default_rng(0)
    shapes = ((1, 5), (3, 77), (2, 128))  # traced at (2, 16); multiple choice at (2, 3, 16), here with 4 options
    batches = [rng.integers(5, CFG.vocab_size, (b, 4, t) if kind == "choice" else (b, t)) for b, t in shapes]
    for ids in batches[1:]:
        ids[0, ..., ids.shape[-1] // 2:] = 0  # a padded row: the mask reaches the attention
    assert onnx_export.check(hf_dir, onnx_path, *batches) <= onnx_export.TOLERANCE


def test_what_has_no_task_is_refused(tmp_path):
    hf_dir = _saved(DebertaForMaskedLM(CFG), tmp_path / "mlm")
    with pytest.raises(ValueError, match="DebertaV2ForMaskedLM cannot be exported to ONNX"):
        onnx_export.export(hf_dir, tmp_path / "onnx")
    with pytest.raises(ValueError, match="not an HF export"):
        onnx_export.export(tmp_path, tmp_path / "onnx")
