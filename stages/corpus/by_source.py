"""Named sources in the corpus artifact: each document's source, the documents each one keeps, sources.json.

With named sources (`RawCorpus.blend`, `--corpus NAME=PATH[:weight=W|:epochs=E] ...`) the first byte of a
document's id is its source's rank in the order listed (`stages.corpus.ingest.doc_digest`). Dedup runs over all
sources at once and keeps the smallest id of every exact group and near-duplicate component, so across sources the
copy kept is the one of the source listed first (within a source, the smallest id, as with one source). The split
files get a `source_name` column read back from that byte; a source left with no documents stops the stage before
anything is written to train/ or validation/. One unnamed source (`--corpus PATH...`) has none of this: its ids,
columns and artifact ids are what they were before sources had names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.corpus_sources import CorpusSource
from core.errors import StageInputError
from stages.corpus.ingest import open_staged, source_rank

SOURCES = "sources.json"
COLUMN = "source_name"
"""The split files' column naming each document's source (only with named sources)."""


def name_column(id_hi: np.ndarray, names: Sequence[str]) -> pa.Array:
    """The `source_name` of documents by their ids' high words."""
    return pa.array(np.asarray(names, dtype=object)[source_rank(id_hi)], pa.string())


def readable(files: Sequence[str], n: int) -> np.ndarray:
    """Readable documents per source rank, counted from the staged blocks' ids (no text read)."""
    counts = np.zeros(n, np.int64)
    for path in files:
        block = open_staged(path, ("id_hi", "reason"))
        ok = pc.is_null(block.column("reason")).to_numpy(zero_copy_only=False)
        counts += np.bincount(source_rank(block.column("id_hi").to_numpy()[ok]), minlength=n)
    return counts


def check_kept(blend: Sequence[CorpusSource], read: np.ndarray, removed_hi: np.ndarray) -> np.ndarray:
    """Documents each source keeps after dedup; StageInputError naming the first source left with none."""
    removed = np.bincount(source_rank(removed_hi), minlength=len(blend))
    kept = read - removed
    for rank in np.flatnonzero(kept == 0):
        src = blend[rank]
        if read[rank] == 0:
            raise StageInputError(f"corpus source {src.name!r} ({src.path}) has no readable documents; point it at "
                                  f"UTF-8 .txt/.jsonl/.parquet files (optionally .gz/.bz2/.zst) or drop it")
        earlier = ", ".join(repr(s.name) for s in blend[:rank])
        raise StageInputError(
            f"corpus source {src.name!r} is empty after dedup: each of its {read[rank]} documents is a copy of one "
            f"of {earlier} (dedup keeps the copy of the source listed first); drop {src.name!r} from --corpus, or "
            f"list it before {earlier}")
    return kept


def write(out: Path, blend: Sequence[CorpusSource], ranks: Sequence[int], read: np.ndarray,
          kept: np.ndarray, filtered: Sequence[int] = ()) -> list[dict]:
    """sources.json: per source, in the order listed, its spec and its documents (read, removed by the quality
    filters, removed as duplicates, kept in each split); what the tokenize stage hands on to pretraining's blend.
    `read`: readable documents the filters kept. StageInputError naming a source with no train document."""
    filtered = np.asarray(filtered or [0] * len(blend), np.int64)
    per_split = {}
    for split in ("train", "validation"):
        names = pq.read_table(out / split, columns=[COLUMN]).column(COLUMN)
        counts = pc.value_counts(names)
        per_split[split] = dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
    for r, src in enumerate(blend):  # pretraining blends the train split: every source needs a row there
        if not per_split["train"].get(src.name):
            raise StageInputError(f"corpus source {src.name!r} has no train documents: its {int(kept[r])} documents "
                                  f"left after dedup all fell in the validation split; add documents to it or drop it")
    files = np.bincount(np.asarray(ranks, np.int64), minlength=len(blend))
    rows = [{"name": s.name, "path": s.path, "weight": s.weight, "epochs": s.epochs, "files": int(files[r]),
             "documents_read": int(read[r] + filtered[r]), "filtered": int(filtered[r]),
             "duplicates_removed": int(read[r] - kept[r]),
             "train_documents": per_split["train"].get(s.name, 0),
             "validation_documents": per_split["validation"].get(s.name, 0)}
            for r, s in enumerate(blend)]
    (out / SOURCES).write_text(json.dumps(rows, indent=2))
    return rows


def load(corpus_dir: Path) -> list[dict] | None:
    """A corpus artifact's sources.json, or None for one unnamed source."""
    path = Path(corpus_dir) / SOURCES
    return json.loads(path.read_text()) if path.exists() else None
