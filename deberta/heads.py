"""The fine-tuning heads on the DeBERTa backbone, one per task kind (DeBERTa §5.1: GLUE, §5.2: SQuAD and NER).

* `DebertaForSequenceClassification` (HF `DebertaV2ForSequenceClassification`): first-token pooler + task-layer
  dropout + linear head; one label = regression with MSE.
* `DebertaForTokenClassification` (HF `DebertaV2ForTokenClassification`): task-layer dropout + linear head on
  every position; cross-entropy over the positions whose label is not `IGNORE_INDEX` (a word's later pieces,
  [CLS], [SEP], padding).
* `DebertaForQuestionAnswering` (HF `DebertaV2ForQuestionAnswering`): a linear H -> 2 head (`qa_outputs`) giving
  start and end logits; loss = mean of the start and end cross-entropies (BERT §4.2, as HF).

Each takes `embedding_delta` for SiFT (`deberta.sift`) and returns {"logits", "loss"?}; `logits` is what SiFT's
divergence compares, softmax over its last axis: (B, C) per example, (B, T, C) per position, and for question
answering (B, 2, T), the start and end distributions over positions (padding masked). Parameter names are HF's,
so `deberta.hf` converts by copying.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deberta.config import DebertaConfig
from deberta.model import IGNORE_INDEX, DebertaModel, init_weights

MASKED_LOGIT = -1e4
"""Start/end logit of a padding position: out of every softmax, finite in bf16 and fp16."""


class ContextPooler(nn.Module):
    """First-token pooler (HF `ContextPooler`): dropout -> dense -> GELU."""

    def __init__(self, cfg: DebertaConfig, dropout: float):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(self.dropout(hidden[:, 0])))  # (B, H)


class _Head(nn.Module):
    """The backbone and the task-layer dropout every head shares; `num_labels` outputs."""

    def __init__(self, cfg: DebertaConfig, num_labels: int, classifier_dropout: float, sift: bool):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"{type(self).__name__}: num_labels={num_labels} must be >= 1")
        self.cfg = cfg
        self.num_labels = num_labels
        self.classifier_dropout = classifier_dropout
        self.deberta = DebertaModel(cfg, sift=sift, _init=False)
        self.dropout = nn.Dropout(classifier_dropout)

    regression = False
    """Whether the head's output is a score (SiFT then compares squared errors, not distributions)."""


class DebertaForSequenceClassification(_Head):
    """Sequence classification / regression (HF `DebertaV2ForSequenceClassification`).

    classifier_dropout: the Table 9 "task-layer dropout" before the classifier (HF `cls_dropout`).
    pooler_dropout: dropout inside the pooler (HF `pooler_dropout`, reference default 0).
    sift: normalise word embeddings before the embedding LayerNorm so `deberta.sift` can perturb them.
    num_labels == 1 means regression: logits (B, 1), loss = MSE against float labels.
    """

    def __init__(self, cfg: DebertaConfig, num_labels: int, classifier_dropout: float, pooler_dropout: float = 0.0,
                 sift: bool = False):
        super().__init__(cfg, num_labels, classifier_dropout, sift)
        self.pooler_dropout = pooler_dropout
        self.pooler = ContextPooler(cfg, pooler_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.apply(lambda m: init_weights(m, cfg))

    @property
    def regression(self) -> bool:
        return self.num_labels == 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, embedding_delta: torch.Tensor | None = None,
                ) -> dict[str, torch.Tensor]:
        """labels (B,): class ids or scores. embedding_delta (B, T, H): SiFT's perturbation (needs sift=True)."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, embedding_delta=embedding_delta)
        logits = self.classifier(self.dropout(self.pooler(hidden)))  # (B, num_labels)
        out = {"logits": logits}
        if labels is not None:
            if self.regression:
                out["loss"] = F.mse_loss(logits.view(-1).float(), labels.view(-1).float())
            else:
                out["loss"] = F.cross_entropy(logits.float(), labels.view(-1).long())
        return out


class DebertaForTokenClassification(_Head):
    """A label per position (HF `DebertaV2ForTokenClassification`): NER, PII detection, chunking."""

    def __init__(self, cfg: DebertaConfig, num_labels: int, classifier_dropout: float, sift: bool = False):
        super().__init__(cfg, num_labels, classifier_dropout, sift)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.apply(lambda m: init_weights(m, cfg))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, embedding_delta: torch.Tensor | None = None,
                ) -> dict[str, torch.Tensor]:
        """labels (B, T): class ids, IGNORE_INDEX where no label is trained."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, embedding_delta=embedding_delta)
        logits = self.classifier(self.dropout(hidden))  # (B, T, num_labels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float().flatten(0, 1), labels.reshape(-1).long(),
                                          ignore_index=IGNORE_INDEX)
        return out


class DebertaForQuestionAnswering(_Head):
    """Extractive QA (HF `DebertaV2ForQuestionAnswering`): start and end logits over the positions.

    HF's head has no dropout before `qa_outputs`; the Table 9 task-layer dropout is applied there here (it is the
    identity at inference, so exported logits are equal)."""

    def __init__(self, cfg: DebertaConfig, classifier_dropout: float, sift: bool = False):
        super().__init__(cfg, 2, classifier_dropout, sift)
        self.qa_outputs = nn.Linear(cfg.hidden_size, 2)
        self.apply(lambda m: init_weights(m, cfg))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, embedding_delta: torch.Tensor | None = None,
                ) -> dict[str, torch.Tensor]:
        """labels (B, 2): the answer's start and end positions ([CLS] = 0 for no answer in this window).
        logits (B, 2, T): start (row 0) and end (row 1) logits, padding at MASKED_LOGIT."""
        hidden, _, _ = self.deberta.encode(input_ids, attention_mask, embedding_delta=embedding_delta)
        logits = self.qa_outputs(self.dropout(hidden)).transpose(1, 2)  # (B, T, 2) -> (B, 2, T)
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool()[:, None, :], MASKED_LOGIT)
        out = {"logits": logits}
        if labels is not None:
            flat = logits.float().flatten(0, 1)  # (B * 2, T): start and end rows
            out["loss"] = F.cross_entropy(flat, labels.reshape(-1).long())  # mean of start and end losses
        return out
