"""ONNX export of a fine-tuned HF export (`deberta.hf.save_pretrained`): the sequence, token, span and
multiple-choice heads, for onnxruntime.

`torch.onnx.export` with the TorchScript exporter (`dynamo=False`): it traces transformers' `DebertaV2For*` once at
a small batch and length, with the batch and sequence axes dynamic. The disentangled attention traces to a graph
that holds at other lengths because transformers derives the relative positions and their log buckets from the
runtime shapes with torch ops; `check` verifies it for each export on real rows of other lengths
(tests/unit/test_onnx_export.py at 5 to 128 positions). The torch.export exporter (`dynamo=True`) would need one
more package (onnxscript) for no gain here.

What it refuses (ValueError): anything but the fine-tuned heads (a masked LM or a bare encoder is not a task
with answers here), and a model whose ONNX logits differ from torch's by more than `TOLERANCE`.

transformers, onnx and onnxruntime are imported inside the functions: the rest of `deberta/` needs torch only.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch

OUTPUTS = {"DebertaV2ForSequenceClassification": ("logits",), "DebertaV2ForTokenClassification": ("logits",),
           "DebertaV2ForQuestionAnswering": ("start_logits", "end_logits"), "DebertaV2ForMultipleChoice": ("logits",)}
"""The exportable architectures and their outputs' names (transformers' own)."""
CHOICES = {"DebertaV2ForMultipleChoice"}
"""Architectures whose inputs are (B, K, T): K options per example, an axis of its own (its logits are (B, K))."""
INPUTS = ("input_ids", "attention_mask")
TOLERANCE = 1e-4
"""Largest |ONNX - torch| logit accepted: fp32 against fp32, so what differs is summation order (~1e-6)."""
OPSET = 17
FILE = "model.onnx"


def architecture(hf_dir: str | Path) -> str:
    """The export's architecture (config.json `architectures`), ValueError for one that cannot be exported."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        raise ValueError(f"{hf_dir} is not an HF export (no config.json); export a model with "
                         f"deberta.hf.save_pretrained, or give the registry's models:/NAME@champion")
    arch = (json.loads(config.read_text()).get("architectures") or [""])[0]
    if arch not in OUTPUTS:
        raise ValueError(f"{hf_dir}: {arch or 'no architecture'} cannot be exported to ONNX here; the fine-tuned "
                         f"heads can ({', '.join(OUTPUTS)}): batch predictions answer a task")
    return arch


def load_torch(hf_dir: str | Path) -> torch.nn.Module:
    """The export as transformers loads it, in eval mode."""
    import transformers

    return getattr(transformers, architecture(hf_dir)).from_pretrained(str(hf_dir)).eval()


def export(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`/model.onnx from the HF export `hf_dir` (written beside and renamed: a file there is whole)."""
    arch = architecture(hf_dir)
    names, choices = OUTPUTS[arch], arch in CHOICES
    model = load_torch(hf_dir)
    model.config.return_dict = False  # a tuple of tensors traces; a ModelOutput's names come from `names`
    shape = (2, 3, 16) if choices else (2, 16)  # (B, T) or (B, K, T): one row padded, so masks trace
    ids = torch.randint(5, min(100, model.config.vocab_size), shape)
    mask = torch.ones_like(ids)
    ids[1, ..., 9:], mask[1, ..., 9:] = 0, 0
    axes = {0: "batch", 1: "choices", 2: "sequence"} if choices else {0: "batch", 1: "sequence"}
    out_axes = {0: "batch", 1: "choices"} if choices else axes
    out = Path(out_dir) / FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{FILE}-{uuid.uuid4().hex[:8]}")
    try:
        with warnings.catch_warnings():  # the tracer's notes on Python values in the graph: checked by `check`
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (ids, mask), str(tmp), input_names=list(INPUTS), output_names=list(names),
                              dynamic_axes={**{n: axes for n in INPUTS}, **{n: out_axes for n in names}},
                              opset_version=OPSET, dynamo=False)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def session(onnx_path: str | Path, threads: int = 0):
    """An onnxruntime CPU session (`threads` intra-op threads; 0: onnxruntime's default, one per core)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])


def run(sess, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Outputs by name for int64 (B, T) ids and mask ((B, K, T) for multiple choice)."""
    got = sess.run(None, {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)})
    return {o.name: v for o, v in zip(sess.get_outputs(), got)}


def difference(hf_dir: str | Path, onnx_path: str | Path, *batches: np.ndarray) -> float:
    """Largest |ONNX - torch| over every output, for batches of token rows (N, T), or (N, K, T) for multiple
    choice, right-padded with 0 ([PAD])."""
    model, sess = load_torch(hf_dir), session(onnx_path)
    worst = 0.0
    for ids in batches:
        mask = (ids != 0).astype(np.int64)
        with torch.inference_mode():
            want = model(input_ids=torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask))
        got = run(sess, ids, mask)
        worst = max(worst, *(float(np.abs(got[n] - want[n].numpy()).max()) for n in got))
    return worst


def check(hf_dir: str | Path, onnx_path: str | Path, *batches: np.ndarray) -> float:
    """`difference`, refused (ValueError) above TOLERANCE: an export that answers differently is not used."""
    diff = difference(hf_dir, onnx_path, *batches)
    if not diff <= TOLERANCE:
        raise ValueError(f"the ONNX export of {hf_dir} differs from torch by {diff:.3g} (> {TOLERANCE:g}) on the "
                         f"input's first rows; predict with --backend torch")
    return diff
