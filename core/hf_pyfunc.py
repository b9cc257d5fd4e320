"""The MLflow Model of every registry version: a pyfunc over a whole `deberta.hf` export ("models from code").

MLflow runs this file, the pipeline never imports it: `Tracker.log_hf_model` (core/lineage.py) logs it with the
export as the model's artifact `hf` (kept as written: config.json, model.safetensors, tokenizer.json, spm.model),
and `mlflow.pyfunc.load_model` / `mlflow models serve` execute it next to that directory. It needs mlflow, pandas,
numpy, torch and transformers; a fine-tuned model also the task kinds' code, which it ships (`code_paths`).

One prediction path: a fine-tuned model's interface names its task kind (a module of `stages/finetune/kinds/`,
shipped in the model), and the kind's own code turns raw inputs into rows and the export's logits into answers,
the code its dev metrics ran (`TaskKind.encode_inputs`, `row_outputs`, `answers`): what is served is what the
sweep measured.

Why a pyfunc of ours rather than MLflow's `transformers` flavor: the flavor's classifier reads only `text` /
`text_pair` columns, and the tasks name theirs `sentence1` / `sentence2` (GLUE's files, our task directories); a
regression head comes back through the flavor as a label "LABEL_0" with a score; and the flavor re-saves the
tokenizer without the SentencePiece model, so its copy could not be fine-tuned from (`finetune.init=models:/...`
reads `hf/` of the version). Here the registry holds the export byte for byte.

Tasks (artifact `interface`: {"task", "inputs", "kind", "auto"}: the transformers auto class) and their DataFrame
interface (a fine-tuned model's is its kind's; these are the built-in kinds'):
    text-classification  sentence1 (+ sentence2 for pair tasks) -> label (the task's label name), score (its
                         probability); a regression head (problem_type "regression") -> score (float) only
                         (`stages/finetune/kinds/sequence.py`)
    token-classification text -> entities: [{entity_group, word, start, end, score}]: the text's words are its
                         runs of non-whitespace, a word's tag its first piece's, entities whole words with
                         text[start:end] == word (`stages/finetune/kinds/token.py`)
    question-answering   question, context -> answer, score, start, end (character offsets into the context;
                         "" when the model says the context holds no answer): the span search of
                         `stages/finetune/kinds/span.py` over windows overlapping by the export's `doc_stride`,
                         "no answer" when the no-answer margin is above `null_score_threshold` (chosen on dev; v2.0)
    multiple-choice      context, question, options (a list of texts per row) -> answer (the chosen option),
                         choice (its index), score (its probability over the options)
                         (`stages/finetune/kinds/choice.py`)
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
        self.kind = None
        if interface.get("kind"):  # a fine-tuned model: its kind's code, shipped in the model, predicts
            import importlib

            self.kind = importlib.import_module(interface["kind"]).KIND
            with open(f"{path}/config.json") as f:
                self.settings = json.load(f)
            self.settings.setdefault("max_seq_len", self.tokenizer.model_max_length)
        self.model = getattr(transformers, interface["auto"]).from_pretrained(path).eval()
        if self.task == "fill-mask":
            self.pipe = transformers.pipeline(self.task, model=self.model, tokenizer=self.tokenizer)
        self.torch = torch

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        frame = pd.DataFrame(model_input)
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise ValueError(f"input has columns {list(frame.columns)}; this model reads {self.columns} "
                             f"(missing {missing})")
        texts = [[_cell(v) for v in frame[c]] for c in self.columns]
        if self.kind is not None:
            return self._kind_answers(dict(zip(self.columns, texts)))
        if self.task == "fill-mask":
            return self._fill_mask(texts[0])
        rows = []
        for start in range(0, len(frame), BATCH):
            enc = self.tokenizer(*[t[start:start + BATCH] for t in texts], truncation=True, padding=True,
                                 return_tensors="pt")
            with self.torch.inference_mode():
                out = self.model(**enc)
            rows += [{"embedding": v.tolist()} for v in out.last_hidden_state[:, 0]]  # (B, H): [CLS]
        return pd.DataFrame(rows)

    def _kind_answers(self, columns: dict[str, list[str]]) -> pd.DataFrame:
        """The kind's prediction path: its features, the export's forward in the dev metrics' batches, its answers."""
        rows = self.kind.encode_inputs(self.tokenizer, columns, self.settings)
        outputs = self.kind.forward_rows(
            lambda ids, mask: self.kind.hf_logits(self.model(input_ids=ids, attention_mask=mask)), rows.ids)
        answers = self.kind.answers(outputs, rows, self.settings)
        return pd.DataFrame(answers) if answers else pd.DataFrame(columns=list(self.kind.answer_columns))

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


def _cell(value):
    """A DataFrame cell as the kinds read it: text, or a list of texts (e.g. a multiple-choice row's options)."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        return str(value)
    return [str(v) for v in value]


mlflow.models.set_model(HFExport())
