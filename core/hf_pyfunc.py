"""The MLflow Model of every registry version: a pyfunc over a whole `deberta.hf` export ("models from code").

MLflow runs this file, the pipeline never imports it: `Tracker.log_hf_model` (core/lineage.py) logs it with the
export as the model's artifact `hf` (kept as written: config.json, model.safetensors, tokenizer.json, spm.model),
and `mlflow.pyfunc.load_model` / `mlflow models serve` execute it next to that directory. It needs mlflow, pandas,
torch and transformers, nothing of this repository.

Why a pyfunc of ours rather than MLflow's `transformers` flavor: the flavor's classifier reads only `text` /
`text_pair` columns, and the tasks name theirs `sentence1` / `sentence2` (GLUE's files, our task directories); a
regression head comes back through the flavor as a label "LABEL_0" with a score; and the flavor re-saves the
tokenizer without the SentencePiece model, so its copy could not be fine-tuned from (`finetune.init=models:/...`
reads `hf/` of the version). Here the registry holds the export byte for byte.

Tasks (artifact `interface`: {"task", "inputs"}) and their DataFrame interface:
    text-classification  sentence1 (+ sentence2 for pair tasks) -> label (the task's label name), score (its
                         probability); a regression head (problem_type "regression") -> score (float) only
    token-classification text -> entities: [{entity_group, word, start, end, score}], character offsets into the
                         text (transformers' pipeline, aggregation "first": a word's tag is its first piece's)
    question-answering   question, context -> answer, score, start, end (character offsets into the context;
                         "" when the model says the context holds no answer). The span search of
                         `stages/finetune/kinds/span.py`, over windows of the context overlapping by the export's
                         `doc_stride`, answers at most `max_answer_len` pieces long, and "no answer" when its
                         score beats the best span's by more than `null_score_threshold` (chosen on dev; v2.0)
    fill-mask            text with [MASK] -> token (best piece at the first [MASK]), score, sequence
    feature-extraction   text -> embedding (the last layer's [CLS] vector, a list of floats)
"""

from __future__ import annotations

import mlflow.models
import mlflow.pyfunc
import pandas as pd

ARTIFACT = "hf"
BATCH = 32  # rows per forward pass: bounds the activation memory of a long DataFrame


class HFExport(mlflow.pyfunc.PythonModel):
    """Predicts with the HF export (artifact `hf`); the task and input columns come from artifact `interface`."""

    def load_context(self, context) -> None:
        import json

        import torch
        import transformers

        with open(context.artifacts["interface"]) as f:
            interface = json.load(f)
        self.task, self.columns = interface["task"], list(interface["inputs"])
        path = context.artifacts[ARTIFACT]
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        auto = {"text-classification": transformers.AutoModelForSequenceClassification,
                "token-classification": transformers.AutoModelForTokenClassification,
                "question-answering": transformers.AutoModelForQuestionAnswering,
                "fill-mask": transformers.AutoModelForMaskedLM,
                "feature-extraction": transformers.AutoModel}[self.task]
        self.model = auto.from_pretrained(path).eval()
        if self.task in ("fill-mask", "token-classification"):
            extra = {"aggregation_strategy": "first"} if self.task == "token-classification" else {}
            self.pipe = transformers.pipeline(self.task, model=self.model, tokenizer=self.tokenizer, **extra)
        self.torch = torch

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        frame = pd.DataFrame(model_input)
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise ValueError(f"input has columns {list(frame.columns)}; this model reads {self.columns} "
                             f"(missing {missing})")
        texts = [[str(v) for v in frame[c]] for c in self.columns]
        if self.task == "fill-mask":
            return self._fill_mask(texts[0])
        if self.task == "token-classification":
            return self._entities(texts[0])
        if self.task == "question-answering":
            return pd.DataFrame([self._answer(q, c) for q, c in zip(*texts)],
                                columns=["answer", "score", "start", "end"])
        rows = []
        for start in range(0, len(frame), BATCH):
            enc = self.tokenizer(*[t[start:start + BATCH] for t in texts], truncation=True, padding=True,
                                 return_tensors="pt")
            with self.torch.inference_mode():
                out = self.model(**enc)
            if self.task == "text-classification":
                rows += self._classify(out.logits)
            else:
                rows += [{"embedding": v.tolist()} for v in out.last_hidden_state[:, 0]]  # (B, H): [CLS]
        return pd.DataFrame(rows)

    def _classify(self, logits) -> list[dict]:
        cfg = self.model.config
        if cfg.problem_type == "regression" or cfg.num_labels == 1:  # the raw score, no sigmoid
            return [{"score": float(v)} for v in logits[:, 0]]
        probs = logits.float().softmax(-1)  # (B, num_labels)
        best = probs.max(-1)
        return [{"label": cfg.id2label[int(i)], "score": float(p)} for p, i in zip(best.values, best.indices)]

    def _fill_mask(self, texts: list[str]) -> pd.DataFrame:
        answers = self.pipe(texts, top_k=1, batch_size=BATCH)
        if len(texts) == 1:  # one text: the pipeline answers with that text's list, not a list of them
            answers = [answers]
        rows = []
        for found in answers:
            best = found[0]
            if isinstance(best, list):  # several [MASK]: one list per mask, the first one answers
                best = best[0]
            rows.append({"token": best["token_str"], "score": float(best["score"]), "sequence": best["sequence"]})
        return pd.DataFrame(rows, columns=["token", "score", "sequence"])

    def _entities(self, texts: list[str]) -> pd.DataFrame:
        found = self.pipe(texts, batch_size=BATCH)
        if len(texts) == 1:
            found = [found]
        rows = [[{"entity_group": e["entity_group"], "word": e["word"], "start": int(e["start"]),
                  "end": int(e["end"]), "score": float(e["score"])} for e in entities] for entities in found]
        return pd.DataFrame({"entities": rows})

    def _answer(self, question: str, context: str) -> dict:
        """The best answer over the context's windows (the pipeline's own span search, as in training)."""
        cfg = self.model.config
        enc = self.tokenizer(question, context, truncation="only_second", stride=getattr(cfg, "doc_stride", 32),
                             max_length=self.tokenizer.model_max_length, return_overflowing_tokens=True,
                             return_offsets_mapping=True, padding=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")
        enc.pop("overflow_to_sample_mapping", None)
        with self.torch.inference_mode():
            out = self.model(**enc)
        longest, null, best = getattr(cfg, "max_answer_len", 30), float("inf"), None
        for w in range(len(offsets)):
            start, end = out.start_logits[w].float(), out.end_logits[w].float()  # (T,) each
            in_context = self.torch.tensor([s == 1 for s in enc.sequence_ids(w)])
            null = min(null, float(start[0] + end[0]))
            for s in start.topk(min(20, len(start))).indices.tolist():
                for e in end.topk(min(20, len(end))).indices.tolist():
                    if in_context[s] and in_context[e] and s <= e < s + longest:
                        score = float(start[s] + end[e])
                        if best is None or score > best[0]:
                            first = int(offsets[w, s, 0])
                            while first < int(offsets[w, e, 1]) and context[first].isspace():
                                first += 1  # the word marker's space is not part of the answer
                            best = (score, first, int(offsets[w, e, 1]))
        threshold = getattr(cfg, "null_score_threshold", None)
        if best is None or (threshold is not None and null - best[0] > threshold):
            return {"answer": "", "score": null - (best[0] if best else null), "start": -1, "end": -1}
        return {"answer": context[best[1]:best[2]], "score": best[0], "start": best[1], "end": best[2]}


mlflow.models.set_model(HFExport())
