"""Corpus ingest: expand patterns to files once, read files into Arrow batches of documents or
rejections, and fingerprint each batch for dedup.

Reading works on a single file with memory bounded by `max_doc_bytes` plus one read chunk, and
yields Arrow batches of at most `corpus.batch_size` documents, so the Ray map over files never
holds more than a batch. Local paths and pyarrow.fs URIs (s3://, gs://, hdfs://, file://) go
through the same pyarrow filesystem calls; only the expansion of a local glob uses Python's `glob`.

Formats, by suffix: `.txt`/`.text` (one document per file, or per non-empty line),
`.jsonl`/`.ndjson` (a string field), `.parquet` (a string column); `.gz`, `.bz2`, `.zst`
decompress transparently (not around Parquet, which compresses internally).

Fingerprints (`fingerprint`, one call per batch): the 128-bit xxh3 of the normalised text (exact
duplicates) and the document's LSH band keys (near duplicates), computed with the batch kernels of
`minhash`; the MinHash signature itself is not kept, its band keys are all later steps need. A block's
documents and fingerprints are staged to one Arrow file (`fingerprint_block`) that every later pass reads.
"""

from __future__ import annotations

import binascii
import fnmatch
import glob
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import xxhash

from core.errors import StageInputError
from core.storage import filesystem, is_uri, split_uri, store_fix
from stages.corpus.minhash import MinHasher, band_keys, normalize
from stages.corpus.langid import classify as languages
from stages.corpus.quality import Filters, first_rule

if TYPE_CHECKING:
    from core.config import CorpusConfig

COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
READ_CHUNK = 1 << 20
SNIFF_BYTES = 8192
BATCH_BYTES = 64 << 20  # text per batch, whatever corpus.batch_size says: bounds a batch of huge documents
# Errors a corrupt or unreadable input raises (zlib/bz2/zstd and Arrow errors are OSError or ValueError).
READ_ERRORS = (OSError, ValueError, EOFError, pa.ArrowException)


@dataclass(frozen=True)
class Record:
    """One document (`text`) or one rejection (`reason`) read from `source` at ordinal `index`."""

    source: str
    index: int
    text: str | None = None
    reason: str | None = None


# ---------------------------------------------------------------- listing


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _hidden(name: str) -> bool:
    """Dot files and `_SUCCESS`/`_metadata`-style markers inside a directory are not corpus files."""
    return name.startswith((".", "_"))


def _stat_local(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except OSError:  # a dangling link or a vanished file: listed, then rejected with its reason on read
        st = os.lstat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def _walk_local(root: str) -> list[tuple[str, int, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _hidden(d))
        out.extend(_stat_local(os.path.join(dirpath, f)) for f in filenames if not _hidden(f))
    return out


def _glob_regex(pattern: str) -> re.Pattern:
    """A glob with `**` (any depth) as a regex over '/'-separated paths."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            j = pattern.find("]", i) if pattern[i] == "[" else -1
            if j > i:
                out.append(fnmatch.translate(pattern[i:j + 1]).removeprefix("(?s:").removesuffix(")\\Z"))
                i = j + 1
            else:
                out.append(re.escape(pattern[i]))
                i += 1
    return re.compile("".join(out) + r"\Z")


def _list_uri(pattern: str) -> list[tuple[str, int, int]]:
    try:
        return _list_store(pattern)
    except (OSError, pa.ArrowException) as e:
        raise StageInputError(f"corpus {pattern}: {store_fix(e)}") from None  # names the URI and the fix


def _list_store(pattern: str) -> list[tuple[str, int, int]]:
    scheme = split_uri(pattern)[0]
    magic = _has_magic(pattern)
    root = pattern[:min(pattern.find(c) for c in "*?[" if c in pattern)] if magic else pattern
    fs, path = filesystem(root)
    if magic:
        base = path.rstrip("/") if root.endswith("/") else path.rsplit("/", 1)[0]
        regex = _glob_regex(_uri_path_pattern(pattern))
        infos = fs.get_file_info(pafs.FileSelector(base or "/", recursive=True, allow_not_found=True))
        infos = [i for i in infos if i.type == pafs.FileType.File and regex.match(i.path)]
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            infos = [i for i in infos if i.type == pafs.FileType.File
                     and not any(_hidden(part) for part in i.path[len(path):].split("/"))]
        else:
            infos = [] if info.type == pafs.FileType.NotFound else [info]
    if not infos and scheme in ("s3", "gs", "gcs"):  # an object store says "not found" for a missing bucket too
        bucket = path.strip("/").split("/", 1)[0]
        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise OSError(f"NoSuchBucket: {bucket}")
    return [(f"{scheme}://{i.path}", i.size or 0, i.mtime_ns or 0) for i in infos]


def _uri_path_pattern(pattern: str) -> str:
    """The path part of a URI glob as pyarrow reports file paths (bucket/key for object stores)."""
    scheme, rest = split_uri(pattern)
    return rest if scheme == "file" else rest.lstrip("/")


def _no_files(pattern: str) -> str:
    """Why `pattern` lists no files, in its own terms: an empty directory, one holding only hidden files, a glob
    matching nothing (the shell may have expanded it), or a path that does not exist."""
    local = os.path.expanduser(pattern)
    if not is_uri(pattern) and not _has_magic(pattern) and os.path.isdir(local):
        hidden = [n for n in os.listdir(local) if _hidden(n)]
        what = (f"holds only hidden files ({', '.join(sorted(hidden)[:3])}), which are skipped" if hidden
                else "is empty")
        return f"corpus directory {pattern!r} {what}; put the text files in it, or pass --corpus PATH to them"
    if _has_magic(pattern):
        return (f"corpus glob {pattern!r} matches no files; check the pattern, and quote it so the shell does not "
                f"expand it (e.g. --corpus 'DIR/**/*.jsonl')")
    if not is_uri(pattern):
        return f"corpus path {pattern!r} does not exist; check the path"
    return f"corpus path {pattern!r} matches no files; check the URI"


def list_sources(patterns: Sequence[str]) -> list[tuple[str, int, int]]:
    """Expand files, directories (recursive), globs (`**` included) and pyarrow.fs URIs.

    Returns sorted, de-duplicated (path, size, mtime_ns); local paths are made absolute so a
    document's id does not depend on the working directory. A pattern matching nothing stops
    the run here, on the driver, before Ray starts.
    """
    if not patterns:
        raise StageInputError("no corpus paths given; pass --corpus PATH (a file, a directory or a quoted glob)")
    found: dict[str, tuple[int, int]] = {}
    for pattern in patterns:
        if is_uri(pattern):
            entries = _list_uri(pattern)
        elif _has_magic(pattern):
            entries = []
            for p in glob.glob(os.path.expanduser(pattern), recursive=True):
                entries.extend(_walk_local(p) if os.path.isdir(p) else [_stat_local(p)])
        elif os.path.isdir(os.path.expanduser(pattern)):
            entries = _walk_local(os.path.expanduser(pattern))
        elif os.path.lexists(os.path.expanduser(pattern)):
            entries = [_stat_local(os.path.expanduser(pattern))]
        else:
            entries = []
        if not entries:
            raise StageInputError(_no_files(pattern))
        for path, size, mtime in entries:
            found[path] = (size, mtime)
    return [(p, s, m) for p, (s, m) in sorted(found.items())]


# ---------------------------------------------------------------- reading


def file_kind(path: str) -> tuple[str | None, str | None]:
    """(format, compression) from the file name; format None when unsupported."""
    name = path.rsplit("/", 1)[-1].lower()
    stem, ext = os.path.splitext(name)
    codec = COMPRESSION.get(ext)
    if codec:
        stem, ext = os.path.splitext(stem)
    fmt = FORMATS.get(ext)
    if fmt == "parquet" and codec:
        return None, codec
    return fmt, codec


def _open_fs(path: str) -> tuple[pafs.FileSystem, str]:
    return filesystem(path)


def _lines(stream, limit: int) -> Iterator[bytes | None]:
    """Every line of a byte stream without its newline; None for a line over `limit` bytes,
    which is skipped chunk by chunk rather than held (a 50 MB one-line file costs one chunk)."""
    pending = bytearray()
    skipping = False
    while chunk := stream.read(READ_CHUNK):
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if skipping:
                yield None
                skipping = False
            else:
                pending += chunk[start:nl]
                yield None if len(pending) > limit else bytes(pending)
            pending.clear()
            start = nl + 1
        if not skipping:
            pending += chunk[start:]
            if len(pending) > limit:
                skipping = True
                pending.clear()
    if skipping:
        yield None
    elif pending:
        yield bytes(pending)


def _decode(raw: bytes, where: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason) for strict UTF-8 (a leading BOM is dropped)."""
    try:
        return raw.decode("utf-8-sig"), None
    except UnicodeDecodeError as e:
        return None, f"{where}invalid UTF-8 at byte {e.start} ({e.reason}); re-encode the file as UTF-8"


class _Sniffed:
    """A stream whose first bytes were read to detect binary content, then replayed."""

    def __init__(self, stream):
        self.stream = stream
        self.head = stream.read(SNIFF_BYTES)

    def read(self, n: int) -> bytes:
        if self.head:
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.stream.read(n)


def _read_text(src: _Sniffed, path: str, fmt: str, opts: CorpusConfig) -> Iterator[Record]:
    limit = opts.max_doc_bytes
    if fmt == "txt" and opts.txt_mode == "document":
        raw = src.read(limit + 1)
        while len(raw) <= limit and (more := src.read(limit + 1 - len(raw))):
            raw += more
        if len(raw) > limit:
            yield Record(path, 0, reason=f"document larger than corpus.max_doc_bytes={limit} bytes")
            return
        text, reason = _decode(raw, "")
        if text is not None and not text.strip():
            text, reason = None, "empty document (whitespace only)"
        yield Record(path, 0, text, reason)
        return
    for i, line in enumerate(_lines(src, limit)):
        where = f"line {i + 1}: "
        if line is None:
            yield Record(path, i, reason=f"{where}longer than corpus.max_doc_bytes={limit} bytes")
            continue
        if not line.strip():
            continue  # blank lines separate nothing and are not documents
        text, reason = _decode(line, where)
        if fmt == "jsonl" and text is not None:
            text, reason = _json_field(text, opts.jsonl_field, where)
        if text is not None and not text.strip():
            text, reason = None, f"{where}empty document (whitespace only)"
        yield Record(path, i, text, reason)


def _json_field(line: str, field: str, where: str) -> tuple[str | None, str | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"{where}invalid JSON ({e.msg} at column {e.colno})"
    value = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(value, str):
        return None, f"{where}no string field {field!r}; set corpus.jsonl_field to the field holding the text"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON may escape a lone surrogate ("\ud83d"), which no UTF-8 text holds
        return None, f"{where}invalid Unicode in {field!r} ({e.reason} at character {e.start})"
    return value, None


def _read_parquet(fs: pafs.FileSystem, fs_path: str, path: str, opts: CorpusConfig) -> Iterator[Record]:
    pf = pq.ParquetFile(fs.open_input_file(fs_path))
    col = opts.parquet_column
    if col not in pf.schema_arrow.names:
        yield Record(path, 0, reason=f"no column {col!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                                     f"set corpus.parquet_column")
        return
    index = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[col]):
        for value in batch.column(0).to_pylist():
            where = f"row {index}: "
            if isinstance(value, bytes):
                value, reason = _decode(value, where)
                if reason:
                    yield Record(path, index, reason=reason)
                    index += 1
                    continue
            if not isinstance(value, str):
                yield Record(path, index, reason=f"{where}{col!r} is {type(value).__name__}, not text")
            elif len(value) > opts.max_doc_bytes // 4 and len(value.encode()) > opts.max_doc_bytes:
                yield Record(path, index, reason=f"{where}larger than corpus.max_doc_bytes={opts.max_doc_bytes} bytes")
            elif not value.strip():
                yield Record(path, index, reason=f"{where}empty document (whitespace only)")
            else:
                yield Record(path, index, value)
            index += 1


def read_file(path: str, opts: CorpusConfig) -> Iterator[Record]:
    """Documents and rejections of one file, in order. Never raises for bad input: a file that
    cannot be opened, decompressed or parsed yields a rejection (after the records read before
    the failure, which are kept), so one corrupt file never stops the corpus."""
    fmt, codec = file_kind(path)
    if fmt is None:
        yield Record(path, -1, reason=f"unsupported file type; use {', '.join(sorted(FORMATS))} "
                                      f"(optionally {', '.join(sorted(COMPRESSION))}, not around .parquet)")
        return
    produced = 0
    try:
        fs, fs_path = _open_fs(path)
        if fmt == "parquet":
            records = _read_parquet(fs, fs_path, path, opts)
        else:
            src = _Sniffed(fs.open_input_stream(fs_path, compression=codec))
            if b"\x00" in src.head:
                yield Record(path, -1, reason=f"binary content (NUL bytes in the first {SNIFF_BYTES} bytes); "
                                              f"not a UTF-8 text file")
                return
            records = _read_text(src, path, fmt, opts)
        for record in records:
            produced += 1
            yield record
    except READ_ERRORS as e:
        what = "cannot open" if produced == 0 else f"read failed after {produced} records"
        yield Record(path, -1, reason=f"{what}: {type(e).__name__}: {e}")
        return
    if produced == 0:
        yield Record(path, -1, reason="file contains no documents (empty)")


def _texts(value) -> bool:
    """Text, or a non-empty list of texts."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value))


def read_fields(path: str, fields: Sequence[str], max_bytes: int) -> Iterator[tuple[int, list | None, str | None]]:
    """(index, values of `fields` or None, reason or None) of every record of one file, by the readers above: a
    `.txt` line (one field: the line), a JSONL object's fields, a Parquet row's columns; compressed as `read_file`
    reads. A field is text or a list of texts (a multiple-choice row's options). A record without a field, or one
    whose field is neither, comes with its reason (the file goes on); a file that
    cannot be read yields one (-1, None, reason). `index` is `read_file`'s, so `doc_id(path, index)` is the corpus
    stage's id of the same record."""
    fmt, codec = file_kind(path)
    if fmt is None:
        yield -1, None, f"unsupported file type; use {', '.join(sorted(FORMATS))}"
        return
    try:
        fs, fs_path = _open_fs(path)
        if fmt == "parquet":
            pf = pq.ParquetFile(fs.open_input_file(fs_path))
            missing = [f for f in fields if f not in pf.schema_arrow.names]
            if missing:
                yield -1, None, f"no column {missing} (columns: {', '.join(pf.schema_arrow.names)})"
                return
            index = 0
            for batch in pf.iter_batches(batch_size=1024, columns=list(fields)):
                for values in zip(*(c.to_pylist() for c in batch.columns)):
                    bad = next((f for f, v in zip(fields, values) if not _texts(v)), None)
                    yield (index, None, f"row {index}: {bad!r} is not text") if bad else (index, list(values), None)
                    index += 1
            return
        src = _Sniffed(fs.open_input_stream(fs_path, compression=codec))
        for i, line in enumerate(_lines(src, max_bytes)):
            if line is not None and not line.strip():
                continue  # blank lines are no records, as in `read_file`
            text, reason = _decode(line, f"line {i + 1}: ") if line is not None else (None, f"line {i + 1}: too long")
            if text is None or fmt == "txt":
                yield i, None if text is None else [text], reason
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield i, None, f"line {i + 1}: invalid JSON ({e.msg} at column {e.colno})"
                continue
            values = [obj.get(f) if isinstance(obj, dict) else None for f in fields]
            bad = next((f for f, v in zip(fields, values) if not _texts(v)), None)
            yield (i, None, f"line {i + 1}: no field {bad!r} of text") if bad else (i, values, None)
    except READ_ERRORS as e:
        yield -1, None, f"read failed: {type(e).__name__}: {e}"


# ---------------------------------------------------------------- Arrow batches for Ray Data


DOC_SCHEMA = pa.schema([("doc_id", pa.string()), ("id_hi", pa.uint64()), ("id_lo", pa.uint64()),
                        ("text", pa.large_string()), ("source", pa.string()), ("reason", pa.string())])


def doc_digest(source: str, index: int, rank: int | None = None) -> bytes:
    """The 128-bit id of the index-th record of a file, big-endian (doc_id is its hex): independent of workers and
    runs. With named sources, the first byte is the rank of the file's source in the order listed (`rank`), so
    ids order by source first: dedup keeps the smallest id of a group, which is then the copy of the first source
    listed, with no rule of its own (`source_rank` reads it back)."""
    digest = xxhash.xxh3_128_digest(f"{source}\x00{index}".encode())
    return digest if rank is None else bytes((rank,)) + digest[1:]


def doc_id(source: str, index: int, rank: int | None = None) -> str:
    """Stable id of the index-th record of a file; ids order like their 128-bit values (id_hi, id_lo)."""
    return doc_digest(source, index, rank).hex()


def source_rank(id_hi: np.ndarray) -> np.ndarray:
    """The source rank of ids made with one (`doc_digest`): their first byte."""
    return (np.asarray(id_hi, np.uint64) >> np.uint64(56)).astype(np.int64)


def _words(digests: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated 16-byte big-endian digests -> their (hi, lo) uint64 halves, which sort like the hex ids."""
    words = np.frombuffer(digests, dtype=">u8").reshape(-1, 2).astype(np.uint64)
    return words[:, 0], words[:, 1]


def _hex(digests: bytes, n: int) -> pa.Array:
    """n concatenated 16-byte big-endian ids -> their 32-digit hex strings, in one pass (no Python str per id)."""
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(32), n, [None, pa.py_buffer(binascii.hexlify(digests))]
                                                ).cast(pa.string())


def hex_ids(hi: np.ndarray, lo: np.ndarray) -> pa.Array:
    """doc_id strings of (hi, lo) ids."""
    words = np.empty((len(hi), 2), dtype=">u8")
    words[:, 0], words[:, 1] = hi, lo
    return _hex(words.tobytes(), len(hi))


def _documents(records: list[Record], ranks: dict[str, int | None], id_paths: dict[str, str]) -> pa.Table:
    digests = b"".join([doc_digest(id_paths[r.source], r.index, ranks[r.source]) for r in records])  # split, hexed by numpy
    hi, lo = _words(digests)
    return pa.table({"doc_id": _hex(digests, len(records)), "id_hi": hi, "id_lo": lo,
                     "text": [r.text for r in records], "source": [r.source for r in records],
                     "reason": [r.reason for r in records]}, schema=DOC_SCHEMA)


def read_files(batch: pa.Table, opts: CorpusConfig, batch_rows: int) -> Iterator[pa.Table]:
    """Ray Data batch function: files (column `path`) -> documents and rejections (DOC_SCHEMA), in
    batches of at most `batch_rows` rows or BATCH_BYTES of text. A `rank` column (named sources) gives each
    file's source rank, the first byte of its documents' ids; an `id_path` column, the name those ids hash in place
    of the path (`RawCorpus.id_paths`)."""
    records: list[Record] = []
    size = 0
    paths = batch.column("path").to_pylist()
    ranks = dict(zip(paths, batch.column("rank").to_pylist() if "rank" in batch.column_names else [None] * len(paths)))
    id_paths = dict(zip(paths, batch.column("id_path").to_pylist() if "id_path" in batch.column_names else paths))
    for path in paths:
        for rec in read_file(path, opts):
            records.append(rec)
            size += len(rec.text) if rec.text else 0
            if len(records) >= batch_rows or size >= BATCH_BYTES:
                yield _documents(records, ranks, id_paths)
                records, size = [], 0
    if records:
        yield _documents(records, ranks, id_paths)


@dataclass(frozen=True)
class Fingerprinter:
    """What `fingerprint` needs, picklable without the pipeline's config (Ray workers get this, not the config)."""

    hasher: MinHasher
    bands: int
    rows: int
    filters: Filters = Filters()


FILTERED = "removed by a corpus filter"
"""The `reason` of a document a rule removed (its `rule` says which): like a rejection, it is not fingerprinted,
deduplicated or written to the splits, but listed in filtered.parquet rather than rejected.parquet."""


DECONTAMINATE = "decontaminate:"
"""The rule of a document removed for sharing an n-gram with a dev example of a task: this prefix and the task."""


def apply_filters(batch: pa.Table, filters: Filters) -> pa.Table:
    """Add rule (the first rule removing the document, "language", or `decontaminate:<task>`; null: kept), value
    (its measure, the top language's probability, or the number of its windows that are the task's dev n-grams)
    and language (the top language; null when identification is off); a removed
    document's reason becomes FILTERED. Before fingerprinting, so dedup never reads what the rules removed."""
    n = batch.num_rows
    if not filters.on:  # nothing to measure: the columns, null, without copying the batch's text
        return (batch.append_column("rule", pa.nulls(n, pa.string())).append_column("value", pa.nulls(n, pa.float64()))
                .append_column("language", pa.nulls(n, pa.string())))
    rule, value = np.full(n, None, object), np.full(n, np.nan)
    language = np.full(n, None, object)
    ok = np.flatnonzero(pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False))
    texts = batch.column("text").take(pa.array(ok))
    if filters.languages and len(ok):
        found, prob = languages(texts.to_pylist())
        language[ok] = found
        off = ~np.isin(found, filters.languages) | (prob < filters.language_threshold)
        rule[ok[off]], value[ok[off]] = "language", prob[off]
    if filters.rules and len(ok):
        left = np.flatnonzero(rule[ok] == None)  # noqa: E711 (elementwise): what language identification kept
        fired, measured = first_rule(texts.take(pa.array(left)), dict(filters.rules))
        rule[ok[left]], value[ok[left]] = fired, measured
    for task, grams in filters.decontaminate if len(ok) else ():  # GPT-3's rule: the whole document goes
        left = np.flatnonzero(rule[ok] == None)  # noqa: E711 (elementwise): what the rules kept
        shared = grams.matches(texts.take(pa.array(left)))[0]
        hit = left[shared > 0]
        rule[ok[hit]], value[ok[hit]] = f"{DECONTAMINATE}{task}", shared[shared > 0]
    removed = rule != None  # noqa: E711
    reasons = pc.if_else(pa.array(removed), pa.scalar(FILTERED, pa.string()), batch.column("reason"))
    return (batch.set_column(batch.schema.get_field_index("reason"), "reason", reasons)
            .append_column("rule", pa.array(rule, pa.string()))
            .append_column("value", pa.array(value, pa.float64(), mask=~removed))
            .append_column("language", pa.array(language, pa.string())))


def fingerprint(batch: pa.Table, fp: Fingerprinter) -> pa.Table:
    """Apply the quality rules (`apply_filters`), then add h_hi, h_lo (xxh3-128 of the normalised text), bands
    (fixed_size_list<uint64>[bands]) and nbytes.

    Rejected and removed rows keep zeros there; a document that normalises to nothing (control or format
    characters only) becomes a rejection here, since there is nothing to keep or compare.
    """
    batch = apply_filters(batch, fp.filters)
    n = batch.num_rows
    reasons = batch.column("reason").to_pylist()
    texts = batch.column("text").to_pylist()
    norms = {i: normalize(texts[i]) for i in range(n) if reasons[i] is None}
    for i, norm in norms.items():
        if not norm:
            reasons[i] = "empty document after normalisation (control or format characters only)"
    keep = np.array([i for i, norm in norms.items() if norm], dtype=np.int64)
    kept = [norms[i] for i in keep]
    h_hi, h_lo = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    h_hi[keep], h_lo[keep] = _words(b"".join([xxhash.xxh3_128_digest(t.encode()) for t in kept]))
    keys = np.zeros((n, fp.bands), np.uint64)
    keys[keep] = band_keys(fp.hasher.signatures(kept, fp.bands * fp.rows), fp.bands, fp.rows)  # (N, B)
    nbytes = pc.fill_null(pc.binary_length(batch.column("text")), 0).cast(pa.int64())
    return (batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))
            .append_column("h_hi", pa.array(h_hi)).append_column("h_lo", pa.array(h_lo))
            .append_column("bands", pa.FixedSizeListArray.from_arrays(pa.array(keys.ravel()), fp.bands))
            .append_column("nbytes", nbytes))


STAGED_COLUMNS = ("doc_id", "id_hi", "id_lo", "text", "source", "reason")
"""The documents' columns of a staged block (what the output splits are written from)."""
FINGERPRINT_COLUMNS = ("id_hi", "id_lo", "reason", "h_hi", "h_lo", "bands")
"""The columns the bucket exchange reads of a staged block: no text."""
BLOCK_SCHEMA = pa.schema([("path", pa.string()), ("rows", pa.int64())])


def fingerprint_block(block: pa.Table, fp: Fingerprinter, stage: str, batch_rows: int) -> pa.Table:
    """Ray Data batch function over a whole block: `fingerprint` it `batch_rows` documents at a time and write its
    documents and their fingerprints to `stage`/<its first doc_id>.arrow; returns one row (path, rows).

    Everything per document stays on disk, so the object store holds one row per block whatever the corpus's
    size, and every later pass reads the staged blocks again: the bucket exchange their fingerprint columns, the
    confirm exchange and the splits their text (Arrow IPC: no decoding, memory-mapped, a column costs only its
    bytes). The name depends only on the block's documents, so a retried task rewrites the same file.
    """
    if not block.num_rows:
        return BLOCK_SCHEMA.empty_table()
    table = pa.concat_tables([fingerprint(block.slice(s, batch_rows), fp) for s in range(0, block.num_rows, batch_rows)])
    path = f"{stage}/{table.column('doc_id')[0].as_py()}.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    return pa.table({"path": [path], "rows": [table.num_rows]}, schema=BLOCK_SCHEMA)


def open_staged(path: str, columns: Sequence[str]) -> pa.Table:
    """`columns` of one staged block, memory-mapped (zero-copy: the buffers keep the mapping open)."""
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all().select(list(columns))


def read_staged(items: dict[str, np.ndarray], columns: Sequence[str]) -> pa.Table:
    """Ray Data batch function: the staged blocks named in `items["path"]`, `columns` of them, read into memory
    (not memory-mapped: Ray Data may keep a batch's buffers past the task, and a mapping with them)."""
    tables = []
    for path in items["path"]:
        with pa.OSFile(str(path)) as f:
            tables.append(pa.ipc.open_file(f).read_all().select(list(columns)))
    return pa.concat_tables(tables)
