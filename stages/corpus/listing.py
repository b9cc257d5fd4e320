"""What the corpus stage can tell from the raw corpus as listed (names, sizes), before Ray starts: the plan's listing
of every source, and the checks `--dry-run` and the real run both make (`check_inputs`, the stage table's
`check_inputs=`).

A file's type is known from its name (`ingest.file_kind`), so a corpus the stage cannot read is refused here rather
than after Ray has started. The text setting is checked against each JSONL file's first record and each Parquet
file's schema (read through the same file-system seam as the stage, compressed or remote alike): a field or column
that is not there is a setting to fix, not a few bad records. How many documents a small corpus holds is counted
by reading it (plain local files only, and only up to what the check needs), so a validation split that will be
empty is said before the run.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import StageInputError
from core.storage import filesystem, is_uri
from stages.corpus.ingest import COMPRESSION, FORMATS, file_kind

if TYPE_CHECKING:
    from core.config import CorpusConfig
# `raw` below is a stages.corpus.RawCorpus (sources, patterns, blend, ranks); not imported: the package imports this.

FIRST_RECORD_CHUNK = 64 << 10
OPENS_AT_ONCE = 16  # files whose first record is read at a time: an object store answers each open in ~50 ms
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


def _first_line(stream, limit: int) -> bytes | None:
    """The first non-blank line of a byte stream (without its newline), read a chunk at a time; None when the stream
    holds none, or runs past `limit` bytes (corpus.max_doc_bytes: the stage rejects such a line) before it ends."""
    head = bytearray()
    while True:
        chunk = stream.read(FIRST_RECORD_CHUNK)
        start = len(head)
        head += chunk
        while (nl := head.find(b"\n", start)) >= 0:
            if head[:nl].strip():
                return bytes(head[:nl])
            del head[:nl + 1]  # a blank line is no record (as the stage reads it)
            start = 0
        if not chunk:
            return bytes(head) if head.strip() else None
        if len(head) > limit:
            return None


def _text_setting_misses(path: str, cfg: "CorpusConfig") -> str | None:
    """Why `path` has no text where the settings look for it, from its first record (JSONL) or its schema (Parquet);
    None when it has, or when that cannot be told (unreadable, not JSON, a record over max_doc_bytes): the stage
    then rejects the file's records with their reasons, as it does records further in that lack the field."""
    fmt, codec = file_kind(path)
    if fmt not in ("jsonl", "parquet"):
        return None
    try:
        fs, fs_path = filesystem(path)
        if fmt == "parquet":
            schema = pq.read_schema(fs_path, filesystem=fs)
            if cfg.parquet_column in schema.names:
                return None
            texts = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
            return _misses(path, "column", cfg.parquet_column, schema.names, texts, "corpus.parquet_column")
        with fs.open_input_stream(fs_path, compression=codec) as stream:
            line = _first_line(stream, cfg.max_doc_bytes)
        record = json.loads(line.decode("utf-8-sig")) if line is not None else None
    except (OSError, ValueError, EOFError, pa.ArrowException):  # unreadable, not JSON: the stage says why, per file
        return None
    if not isinstance(record, dict) or cfg.jsonl_field in record:
        return None
    texts = sorted((k for k, v in record.items() if isinstance(v, str)), key=lambda k: -len(record[k]))  # longest first
    return _misses(path, "field", cfg.jsonl_field, list(record), texts, "corpus.jsonl_field")


def _misses(path: str, what: str, name: str, names: list[str], texts: list[str], setting: str) -> str:
    """One line: the file, what it lacks, what it holds, and the setting to change (naming a text field it has)."""
    where = f"corpus file {path}: its first record" if what == "field" else f"corpus file {path}"
    return (f"{where} has no {what} {name!r} ({what}s: {', '.join(map(str, names)) or 'none'}); set {setting} to "
            f"the {what} holding the text, e.g. --set {setting}={texts[0] if texts else 'NAME'}")


def check_text_settings(raw, cfg: "CorpusConfig") -> None:
    """StageInputError naming the first JSONL/Parquet file without the configured text field or column (and how
    many more lack it), from every file's first record or schema."""
    paths = [p for p, _, _ in raw.sources]
    with ThreadPoolExecutor(OPENS_AT_ONCE) as pool:
        misses = [m for m in pool.map(lambda p: _text_setting_misses(p, cfg), paths) if m is not None]
    if misses:
        more = f" (and {len(misses) - 1} more file(s) like it)" if len(misses) > 1 else ""
        raise StageInputError(misses[0] + more)


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
    check_text_settings(raw, cfg)
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
