"""What the corpus stage can tell from the raw corpus as listed (names, sizes), before Ray starts: the plan's listing
of every source, and the checks `--dry-run` and the real run both make (`check_inputs`, the stage table's
`check_inputs=`).

A file's type is known from its name (`ingest.file_kind`), so a corpus the stage cannot read is refused here rather
than after Ray has started. How many documents a small corpus holds is counted by reading it (plain local files
only, and only up to what the check needs), so a validation split that will be empty is said before the run.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from core.errors import StageInputError
from core.storage import is_uri
from stages.corpus.ingest import COMPRESSION, FORMATS, file_kind

if TYPE_CHECKING:
    from core.config import CorpusConfig
# `raw` below is a stages.corpus.RawCorpus (sources, patterns, blend, ranks); not imported: the package imports this.

READABLE = (f"{', '.join(sorted(FORMATS))} (optionally compressed: {', '.join(sorted(COMPRESSION))}, "
            f"not around .parquet)")


def _mb(size: int) -> str:
    return f"{size:,} bytes" if size < 10_000 else f"{size / 1e6:,.1f} MB"


def groups(raw) -> list[tuple[str, str, list[tuple[str, int, int]]]]:
    """(name, what was asked for, its files) per source: the named ones in order, or one unnamed source."""
    if not raw.blend:
        return [("(unnamed)", " ".join(raw.patterns), list(raw.sources))]
    by_rank: dict[int, list] = {r: [] for r in range(len(raw.blend))}
    for f, rank in zip(raw.sources, raw.ranks):
        by_rank[rank].append(f)
    return [(s.name, s.spec(), by_rank[r]) for r, s in enumerate(raw.blend)]


def describe(raw) -> str:
    """The corpus as the run will read it: every source, its files' count and bytes (what `--dry-run` prints)."""
    total = sum(f[1] for f in raw.sources)
    lines = [f"corpus: {len(raw.sources)} file(s), {_mb(total)}, in {max(1, len(raw.blend))} source(s)"]
    for name, spec, files in groups(raw):
        skipped = sum(1 for f in files if file_kind(f[0])[0] is None)
        lines.append(f"  {name:<12} {spec}: {len(files)} file(s), {_mb(sum(f[1] for f in files))}"
                     + (f", {skipped} of an unreadable type (skipped)" if skipped else ""))
    return "\n".join(lines)


def dry_run(cfg: "CorpusConfig", inputs: dict | None = None) -> str:
    """`--dry-run` of the corpus stage: the listing of the raw corpus, when this run lists it."""
    raw = (inputs or {}).get("raw")
    return describe(raw) if raw is not None else "corpus: built from the raw corpus listed by an earlier run"


def _count_in(path: str, fmt: str, txt_mode: str, limit: int) -> int | None:
    """Documents in one plain local file, counting no further than `limit`; None when it cannot be told cheaply."""
    if is_uri(path) or file_kind(path)[1] is not None:
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # an unreadable file is the stage's to reject, with its reason
            return None
    if fmt == "txt" and txt_mode == "document":
        return 1 if os.path.getsize(path) > 0 else 0
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
            if n >= limit:
                break
    return n


def count_documents(raw, cfg: "CorpusConfig", limit: int) -> int | None:
    """Documents in the corpus's readable files, counted up to `limit`; None when some file cannot be counted
    without reading it whole (compressed, remote)."""
    n = 0
    for path, _, _ in raw.sources:
        fmt = file_kind(path)[0]
        if fmt is None:
            continue
        got = _count_in(path, fmt, cfg.txt_mode, limit - n)
        if got is None:
            return None
        n += got
        if n >= limit:
            break
    return n


def check_inputs(cfg: "CorpusConfig", *, listing: dict, planned: frozenset[str]) -> list[str]:
    """Refuse a corpus the stage cannot read (no file of a readable type, in the whole corpus or in one named
    source) or one whose validation split will be empty when pretraining needs it; warn of skipped files."""
    raw = listing.get("raw")
    if raw is None:
        return []
    warnings = []
    for name, spec, files in groups(raw):
        unreadable = [f[0] for f in files if file_kind(f[0])[0] is None]
        where = f"corpus source {name!r} ({spec})" if raw.blend else f"corpus {spec or 'path'}"
        if unreadable and len(unreadable) == len(files):
            shown = ", ".join(os.path.basename(p) for p in unreadable[:3]) + (", ..." if len(unreadable) > 3 else "")
            raise StageInputError(f"{where}: none of its {len(files)} file(s) is of a type the corpus stage reads "
                                  f"({shown}); it reads {READABLE}: rename the files or point --corpus at the text")
        if unreadable:
            warnings.append(f"{where}: {len(unreadable)} of {len(files)} files are of an unreadable type and are "
                            f"skipped (e.g. {unreadable[0]}); the corpus stage reads {READABLE}")
    need = math.ceil(1 / cfg.validation_fraction)
    docs = count_documents(raw, cfg, need)
    if docs is not None and docs < need:
        message = (f"the corpus holds {docs} document(s); its {cfg.validation_fraction:g} validation split "
                   f"(corpus.validation_fraction) is expected to hold {docs * cfg.validation_fraction:.2g} of them, "
                   f"so it will most likely be empty")
        if "pretrain" in planned:
            raise StageInputError(f"{message} and pretraining would have nothing to validate on; add text (at "
                                  f"least {need} documents), or plan only --until tokenize")
        warnings.append(f"{message}; add text (at least {need} documents) before pretraining on it")
    return warnings


def text_bytes(raw) -> int | None:
    """Bytes of text in the corpus's readable files, or None when some are compressed (Parquet included): then the
    listing does not tell."""
    total = 0
    for path, size, _ in raw.sources:
        fmt, codec = file_kind(path)
        if fmt is None:
            continue
        if codec is not None or fmt == "parquet":
            return None
        total += size
    return total
