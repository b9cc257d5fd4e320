"""The fine-tuning heads on the DeBERTa backbone, one per task kind (DeBERTa §5.1: GLUE, §5.2: SQuAD and NER).

* `DebertaForSequenceClassification` (HF `DebertaV2ForSequenceClassification`): first-token pooler + task-layer
  dropout + linear head; one label = regression with MSE.
* `DebertaForTokenClassification` (HF `DebertaV2ForTokenClassification`): task-layer dropout + linear head on
  every position; cross-entropy over the positions whose label is not `IGNORE_INDEX` (a word's later pieces,
  [CLS], [SEP], padding).
* `DebertaForQuestionAnswering` (HF `DebertaV2ForQuestionAnswering`): a linear H -> 2 head (`qa_outputs`) giving
  start and end logits; loss = mean of the start and end cross-entropies (BERT §4.2, as HF).
* `DebertaForMultipleChoice` (HF `DebertaV2ForMultipleChoice`): each option read with its context as one sequence,
  one score per option from the first-token pooler, cross-entropy over the options (RACE, SWAG; DeBERTa §5.1.1).

Each takes `embedding_delta` for SiFT (`deberta.sift`) and returns {"logits", "loss"?}; `logits` is what SiFT's
divergence compares, softmax over its last axis: (B, C) per example, (B, T, C) per position, and for question
answering (B, 2, T), the start and end distributions over positions (padding masked), for multiple choice (B, K)
over the K options. Parameter names are HF's, so `deberta.hf` converts by copying; each head names its HF class
(`hf_class`), its transformers pipeline tag and the HF config fields of its own (`hf_config`), so `deberta.hf`
exports any head without a branch per class.
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


class TaskHead(nn.Module):
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
    hf_class = ""
    """The transformers class its export is (`deberta.hf.to_transformers`)."""
    pipeline_tag = "feature-extraction"
    """The transformers pipeline (model card tag) of its export."""

    def hf_config(self, labels) -> dict:
        """HF config fields of this head besides the backbone's: its task-layer dropout, and for a classifier
        `num_labels`, `id2label`/`label2id` from `labels` (index = class id) and `problem_type`."""
        return {"cls_dropout": self.classifier_dropout}

    def _label_config(self, labels) -> dict:
        if self.regression:
            names = list(labels or ["score"])
            problem = "regression"  # the text-classification pipeline then returns the raw score, not a sigmoid
        else:
            names = list(labels) if labels else [f"LABEL_{i}" for i in range(self.num_labels)]
            problem = "single_label_classification"
        if len(names) != self.num_labels or len(set(names)) != len(names):
            raise ValueError(f"labels={names} must be {self.num_labels} distinct names, one per classifier output "
                             f"(the task's label names, index = class id; none for regression)")
        return {"num_labels": self.num_labels, "id2label": dict(enumerate(names)),
                "label2id": {n: i for i, n in enumerate(names)}, "problem_type": problem}


class DebertaForSequenceClassification(TaskHead):
    """Sequence classification / regression (HF `DebertaV2ForSequenceClassification`).

    classifier_dropout: the Table 9 "task-layer dropout" before the classifier (HF `cls_dropout`).
    pooler_dropout: dropout inside the pooler (HF `pooler_dropout`, reference default 0).
    sift: normalise word embeddings before the embedding LayerNorm so `deberta.sift` can perturb them.
    num_labels == 1 means regression: logits (B, 1), loss = MSE against float labels.
    """

    hf_class = "DebertaV2ForSequenceClassification"
    pipeline_tag = "text-classification"

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

    def hf_config(self, labels) -> dict:
        return {**super().hf_config(labels), "pooler_dropout": self.pooler_dropout,
                "pooler_hidden_size": self.cfg.hidden_size, "pooler_hidden_act": "gelu", **self._label_config(labels)}

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


class DebertaForTokenClassification(TaskHead):
    """A label per position (HF `DebertaV2ForTokenClassification`): NER, PII detection, chunking."""

    hf_class = "DebertaV2ForTokenClassification"
    pipeline_tag = "token-classification"

    def hf_config(self, labels) -> dict:
        return {**super().hf_config(labels), **self._label_config(labels)}

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


class DebertaForQuestionAnswering(TaskHead):
    """Extractive QA (HF `DebertaV2ForQuestionAnswering`): start and end logits over the positions.

    HF's head has no dropout before `qa_outputs`; the Table 9 task-layer dropout is applied there here (it is the
    identity at inference, so exported logits are equal)."""

    hf_class = "DebertaV2ForQuestionAnswering"
    pipeline_tag = "question-answering"

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


class DebertaForMultipleChoice(DebertaForSequenceClassification):
    """Multiple choice (HF `DebertaV2ForMultipleChoice`): input (B, K, T), each of the K options read with its
    context as one sequence; the sequence head with one output scores each, softmax over the options.

    Its parameters are the one-output sequence head's (pooler, classifier), as HF's are."""

    hf_class = "DebertaV2ForMultipleChoice"
    pipeline_tag = "multiple-choice"
    regression = False  # a distribution over the options, which SiFT compares as any classifier's

    def __init__(self, cfg: DebertaConfig, classifier_dropout: float, pooler_dropout: float = 0.0, sift: bool = False):
        super().__init__(cfg, 1, classifier_dropout, pooler_dropout, sift)

    def hf_config(self, labels) -> dict:
        return {"cls_dropout": self.classifier_dropout, "pooler_dropout": self.pooler_dropout,
                "pooler_hidden_size": self.cfg.hidden_size, "pooler_hidden_act": "gelu"}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, embedding_delta: torch.Tensor | None = None,
                ) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask (B, K, T); labels (B,): the right option's index; embedding_delta (B, K, T, H).
        logits (B, K): one score per option."""
        b, k = input_ids.shape[:2]
        flat = lambda x: None if x is None else x.flatten(0, 1)  # noqa: E731 - (B, K, ...) -> (B * K, ...)
        hidden, _, _ = self.deberta.encode(flat(input_ids), flat(attention_mask), embedding_delta=flat(embedding_delta))
        logits = self.classifier(self.dropout(self.pooler(hidden))).view(b, k)  # (B, K)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float(), labels.view(-1).long())
        return out
