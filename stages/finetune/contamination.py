"""How much of the task's dev split the checkpoint read while pretraining: the fraction of dev examples sharing a
13-gram of normalised words with the train shards of the corpus artifact it was pretrained on (GPT-3's measure,
Brown et al. 2020, App. C; `core.contamination`). A dev metric on examples the model has read is not a
measurement; this figure says how much of the metric could be one.

One Ray Data pass over the shards (read through their store, `core.storage`) with the dev keys as the map's
argument (put in the object store once); each batch returns only the keys it found. The figure is cached per (corpus
artifact, task), both immutable ids, as a small JSON in the workdir. A fine-tune of an external checkpoint
(`finetune.init`) has no corpus artifact: "unknown".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core import storage
from core.contamination import NGRAM, DevGrams, figure
from stages.finetune.kinds.base import TaskRef

UNKNOWN = "unknown"
CACHE = "contamination"  # workdir/contamination/<corpus id>-<task id>.json


def _found(batch: pa.Table, grams: DevGrams) -> pa.Table:
    """Ray Data batch function: the distinct dev keys the batch's documents hold."""
    return pa.table({"key": pa.array(grams.matches(batch.column("text"))[1], pa.uint64())})


def _scan(train: str, grams: DevGrams) -> np.ndarray:
    import ray

    fs, path = storage.filesystem(train)
    ds = ray.data.read_parquet(path, filesystem=fs, columns=["text"])
    keys = [b["key"] for b in ds.map_batches(_found, batch_format="pyarrow", fn_kwargs={"grams": grams})
            .iter_batches(batch_format="numpy")]
    return np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.uint64)


def measure(corpus: Any, task: TaskRef, workdir: Path) -> dict[str, Any]:
    """{"figure": "12 of 1,409 (0.9%)", "contaminated": 12, "examples": 1409, "fraction": 0.0085} of the task's dev
    split against `corpus` (the corpus Artifact, or None: {"figure": "unknown"})."""
    if corpus is None:
        return {"figure": UNKNOWN}
    cache = Path(workdir) / CACHE / f"{corpus.id}-{task.id}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    grams = DevGrams.of(task.kind.texts(task.dev), NGRAM)
    train = storage.join(corpus.uri, "train") if corpus.uri else str(Path(corpus.path) / "train")
    hit = len(grams.contaminated(_scan(train, grams)))
    out = {"figure": figure(hit, grams.examples), "contaminated": hit, "examples": grams.examples,
           "fraction": hit / max(grams.examples, 1), "corpus": corpus.id, "task": task.id, "ngram": NGRAM}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, cache)
    return out


def tags(found: dict[str, Any]) -> dict[str, str]:
    """The registry version's tags: the figure, and its numbers when known."""
    if found["figure"] == UNKNOWN:
        return {"dev_contamination": UNKNOWN}
    return {"dev_contamination": found["figure"], "dev_contaminated_examples": str(found["contaminated"]),
            "dev_contamination_fraction": f"{found['fraction']:.6f}"}
