"""What the corpus stage took out before dedup, kept beside the shards: rejected input and filtered documents.

One streaming pass over the staged blocks (`audit_rows`, then `write` on the driver a batch at a time) yields
rejected.parquet (path, reason: unreadable files, undecodable or oversized records), filtered.parquet (every
document a quality rule or language identification removed: doc_id, path, source, rule, value, language), the
corpus's text bytes, and the counts the report needs: documents read per source, removals per rule x source,
documents per language. Nothing is removed silently: `warnings` names each rule that took more than half of a
source, with the setting to change, and `plot` draws the removals by rule and source (filters.png).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.errors import StageInputError
from stages.corpus.by_source import name_column

REJECTED, FILTERED, PLOT = "rejected.parquet", "filtered.parquet", "filters.png"
REJECT_SCHEMA = pa.schema([("path", pa.string()), ("reason", pa.string())])
FILTER_SCHEMA = pa.schema([("doc_id", pa.string()), ("path", pa.string()), ("source", pa.string()),
                           ("rule", pa.string()), ("value", pa.float64()), ("language", pa.string())])
AUDIT_SCHEMA = pa.schema([("kind", pa.string()), ("path", pa.string()), ("reason", pa.string()),
                          ("doc_id", pa.string()), ("source", pa.string()), ("rule", pa.string()),
                          ("value", pa.float64()), ("language", pa.string()), ("count", pa.int64())])
COLUMNS = ("doc_id", "id_hi", "source", "reason", "nbytes", "rule", "value", "language")
"""The staged columns the pass reads (no text)."""
UNNAMED = "corpus"  # the source of every document when the sources are not named
WARN_SHARE = 0.5


def _sources(batch: pa.Table, names: Sequence[str]) -> pa.Array:
    if names:
        return name_column(batch.column("id_hi").to_numpy(), names)
    return pa.array(np.full(batch.num_rows, UNNAMED, object), pa.string())


def _counts(kind: str, keys: dict[str, pa.Array]) -> pa.Table:
    """One row per distinct combination of `keys`, with its count."""
    table = pa.table(keys)
    if not table.num_rows:
        return AUDIT_SCHEMA.empty_table()
    grouped = table.group_by(list(keys)).aggregate([([], "count_all")])
    n = grouped.num_rows
    return pa.table({"kind": pa.array([kind] * n, pa.string()), **{k: grouped.column(k) for k in keys},
                     "count": grouped.column("count_all").cast(pa.int64())})


def audit_rows(batch: pa.Table, names: Sequence[str] = ()) -> pa.Table:
    """Ray Data batch function over staged rows (COLUMNS): the batch's rejections and filtered documents, a row per
    source of documents read (readable before the rules), a row per source and language, and one row of text
    bytes (`kind`: rejected, filtered, read, language, bytes), all in AUDIT_SCHEMA."""
    source = _sources(batch, names)
    rule_on = pc.is_valid(batch.column("rule"))
    rejected = pc.and_(pc.is_valid(batch.column("reason")), pc.invert(rule_on))
    read = pc.invert(rejected)
    bad, gone = batch.filter(rejected), batch.filter(rule_on)
    pieces = [
        pa.table({"kind": pa.array(["rejected"] * bad.num_rows, pa.string()), "path": bad.column("source"),
                  "reason": bad.column("reason")}),
        pa.table({"kind": pa.array(["filtered"] * gone.num_rows, pa.string()), "path": gone.column("source"),
                  "doc_id": gone.column("doc_id"), "source": source.filter(rule_on), "rule": gone.column("rule"),
                  "value": gone.column("value"), "language": gone.column("language")}),
        _counts("read", {"source": source.filter(read)}),
        _counts("language", {"source": source.filter(read), "language": batch.column("language").filter(read)}),
        pa.table({"kind": ["bytes"], "count": [int(pc.sum(batch.column("nbytes")).as_py() or 0)]}),
    ]
    return pa.concat_tables([_conform(p) for p in pieces])


def _conform(table: pa.Table) -> pa.Table:
    n = table.num_rows
    return pa.table({f.name: table.column(f.name).cast(f.type) if f.name in table.column_names
                     else pa.nulls(n, f.type) for f in AUDIT_SCHEMA}, schema=AUDIT_SCHEMA)


@dataclass
class Audit:
    """The pass's totals."""

    rejected: int = 0
    filtered: int = 0
    text_bytes: int = 0
    read: Counter = field(default_factory=Counter)  # source -> documents readable before the rules
    removed: Counter = field(default_factory=Counter)  # (rule, source) -> documents removed
    languages: Counter = field(default_factory=Counter)  # top language -> documents (identification on)

    def removed_from(self, source: str) -> int:
        return sum(n for (_, s), n in self.removed.items() if s == source)

    def summary(self) -> dict:
        """report.json's "filters" section."""
        by_rule: dict[str, dict[str, int]] = {}
        for (rule, source), n in sorted(self.removed.items()):
            by_rule.setdefault(rule, {})[source] = n
        return {"removed": self.filtered, "read_by_source": dict(sorted(self.read.items())),
                "removed_by_rule_and_source": by_rule, "languages": dict(self.languages.most_common())}

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: documents removed per rule and source, and in all."""
        return {"filtered_documents": self.filtered,
                **{f"filtered.{rule}.{source}": n for (rule, source), n in sorted(self.removed.items())}}


def write(ds, out: Path) -> Audit:
    """Stream `audit_rows` batches into rejected.parquet and filtered.parquet under `out`; their totals."""
    audit = Audit()
    with pq.ParquetWriter(out / REJECTED, REJECT_SCHEMA) as rejected, \
            pq.ParquetWriter(out / FILTERED, FILTER_SCHEMA) as filtered:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            batch = pa.table(batch)
            kind = batch.column("kind")
            rows = {k: batch.filter(pc.equal(kind, k)) for k in ("rejected", "filtered", "read", "language", "bytes")}
            if rows["rejected"].num_rows:
                rejected.write_table(rows["rejected"].select(REJECT_SCHEMA.names))
                audit.rejected += rows["rejected"].num_rows
            if rows["filtered"].num_rows:
                table = rows["filtered"].select(FILTER_SCHEMA.names)
                filtered.write_table(table)
                audit.filtered += table.num_rows
                audit.removed.update(zip(table.column("rule").to_pylist(), table.column("source").to_pylist()))
            for r in rows["read"].to_pylist():
                audit.read[r["source"]] += r["count"]
            for r in rows["language"].to_pylist():
                if r["language"] is not None:
                    audit.languages[r["language"]] += r["count"]
            audit.text_bytes += int(pc.sum(rows["bytes"].column("count")).as_py() or 0)
    return audit


def warnings(audit: Audit) -> list[str]:
    """One line per rule that removed more than half of a source's documents, naming the setting."""
    out = []
    for (rule, source), n in sorted(audit.removed.items()):
        read = audit.read.get(source, 0)
        if read and n > WARN_SHARE * read:
            setting = ("corpus.languages / corpus.language_threshold" if rule == "language"
                       else "corpus.decontaminate" if rule.startswith("decontaminate:")
                       else f"corpus.filters ({rule}=off, or another threshold)")
            out.append(f"warning: corpus rule {rule} removed {n:,} of the {read:,} documents of source {source!r} "
                       f"({n / read:.0%}); if that is not junk, change {setting}")
    return out


def check_left(audit: Audit) -> None:
    """StageInputError naming the rules when they removed every readable document of a source (or of the corpus):
    the stage would have nothing of it to deduplicate or train on."""
    for source, read in sorted(audit.read.items()):
        rules = Counter({rule: n for (rule, s), n in audit.removed.items() if s == source})
        if read and audit.removed_from(source) == read:
            top = ", ".join(f"{n:,} by {rule}" for rule, n in rules.most_common(3))
            what = "the corpus" if source == UNNAMED else f"corpus source {source!r}"
            raise StageInputError(f"the corpus filters removed every one of the {read:,} readable documents of {what} "
                                  f"({top}; each listed with its value in {FILTERED}); loosen corpus.filters or "
                                  f"corpus.languages")


def plot(audit: Audit, path: Path) -> None:
    """Documents removed by rule (rows) and source (stacked bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = sorted({r for r, _ in audit.removed}, key=lambda r: -sum(n for (q, _), n in audit.removed.items()
                                                                      if q == r))
    sources = sorted(audit.read)
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * max(len(rules), 1)))
    left = np.zeros(len(rules))
    for source in sources:
        counts = np.array([audit.removed.get((r, source), 0) for r in rules], float)
        ax.barh(rules, counts, left=left, label=f"{source} ({audit.read[source]:,} read)")
        left += counts
    ax.invert_yaxis()
    ax.set_xlabel("documents removed (first rule that fires)")
    ax.set_title(f"{audit.filtered:,} of {sum(audit.read.values()):,} documents removed by the corpus filters"
                 if rules else "no document removed by the corpus filters")
    if sources and rules:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
