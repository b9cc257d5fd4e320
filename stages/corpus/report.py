"""What the corpus stage tells its readers: report.json, examples.json and dedup.png.

report.json: counts (in = out + removed + rejected), bytes, per-step timings, the LSH parameters, the
config, and the dedup picture in numbers (similarity histogram of the candidate pairs, confirmed and
rejected, and the size distribution of exact groups and near-duplicate clusters). dedup.png draws
the same two distributions; examples.json holds a few duplicate pairs with text, spanning the
similarity range, for a reader to judge the threshold by eye. The executor logs all three (they are
the StageResult's `log_files`) to the stage's MLflow run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from core.config import CorpusConfig

REPORT, EXAMPLES, PLOT = "report.json", "examples.json", "dedup.png"
EXAMPLE_PAIRS = 5
HIST_BINS = np.round(np.linspace(0.0, 1.0, 41), 3)  # 0.025 wide: the threshold (a multiple of 0.05) is an edge


@dataclass
class DedupPicture:
    """The distributions behind the report and the plot (all duplicate-sized)."""

    threshold: float
    candidate_similarity: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Exact Jaccard of every distinct candidate pair (confirmed ones are >= threshold)."""
    exact_group_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Documents per exact-duplicate group (>= 2)."""
    near_cluster_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Documents per near-duplicate cluster (connected component of confirmed pairs, >= 2)."""
    bucket_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Exact survivors per colliding LSH bucket (>= 2), over all bands."""

    def summary(self) -> dict:
        sim = self.candidate_similarity
        confirmed = sim >= self.threshold
        counts, _ = np.histogram(sim, bins=HIST_BINS)
        return {
            "similarity_histogram": {"bin_edges": HIST_BINS.tolist(), "candidate_pairs": counts.tolist(),
                                     "confirmed_pairs": np.histogram(sim[confirmed], bins=HIST_BINS)[0].tolist()},
            "confirmed_similarity_quantiles": _quantiles(sim[confirmed]),
            "exact_group_sizes": _size_distribution(self.exact_group_sizes),
            "near_cluster_sizes": _size_distribution(self.near_cluster_sizes),
            "bucket_sizes": _size_distribution(self.bucket_sizes),
        }


def _quantiles(x: np.ndarray) -> dict[str, float]:
    qs = (0.0, 0.1, 0.5, 0.9, 1.0)
    return {f"q{int(q * 100)}": round(float(v), 4) for q, v in zip(qs, np.quantile(x, qs))} if len(x) else {}


def _size_distribution(sizes: np.ndarray) -> dict[str, int]:
    """{size: number of groups of that size}, sizes as strings (JSON keys)."""
    values, counts = np.unique(np.asarray(sizes, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, counts)}


def plot(picture: DedupPicture, path: Path) -> None:
    """Two panels: the similarity histogram of candidate pairs (confirmed vs rejected), and group sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    sim = picture.candidate_similarity
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist([sim[sim >= picture.threshold], sim[sim < picture.threshold]], bins=HIST_BINS, stacked=True,
              color=["tab:red", "tab:gray"], label=["confirmed (removed or kept as survivor)", "rejected candidate"])
    left.axvline(picture.threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {picture.threshold}")
    left.set_xlabel("exact Jaccard of character shingles")
    left.set_ylabel("candidate pairs")
    left.set_title(f"{int((sim >= picture.threshold).sum()):,} of {len(sim):,} candidate pairs confirmed")
    left.legend(fontsize=8)
    for sizes, label, marker in ((picture.exact_group_sizes, "exact groups", "o"),
                                 (picture.near_cluster_sizes, "near-duplicate clusters", "s")):
        values, counts = np.unique(np.asarray(sizes, dtype=np.int64), return_counts=True)
        if len(values):
            right.plot(values, counts, marker=marker, linestyle="-", label=label)
    right.set_xscale("log")
    right.set_yscale("log")
    right.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    right.xaxis.set_minor_formatter(ticker.NullFormatter())
    right.set_xlabel("documents per group")
    right.set_ylabel("groups")
    right.set_title("duplicate group sizes")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def example_pairs(edges: pa.Table) -> pa.Table:
    """The near pairs examples.json quotes: a few spanning the similarity range."""
    if not edges.num_rows:
        return edges
    order = np.argsort(edges.column("similarity").to_numpy(), kind="stable")
    return edges.take(pa.array(np.unique(order[np.linspace(0, len(order) - 1, min(EXAMPLE_PAIRS, len(order)))
                                               .astype(int)])))


def examples(exact: pa.Table, edges: pa.Table, snippets: dict[str, str]) -> list[dict]:
    """A few duplicate pairs for report readers and MLflow: two exact groups, and the near pairs of
    `example_pairs` with the first characters of both texts (`snippets`, by doc_id)."""
    exact = exact.sort_by("doc_id")
    out = [{"kind": "exact", "similarity": 1.0, "doc_a": row["kept_doc_id"], "doc_b": row["doc_id"]}
           for row in exact.slice(0, 2).to_pylist()]
    for row in example_pairs(edges).to_pylist():
        out.append({"kind": "near", "similarity": round(row["similarity"], 4), "doc_a": row["a"], "doc_b": row["b"],
                    "text_a": snippets.get(row["a"]), "text_b": snippets.get(row["b"])})
    return out


def counts(files: int, n_docs: int, n_rejected: int, n_split: dict[str, int], n_exact: int, n_near: int,
           n_confirmed: int, picture: DedupPicture, n_filtered: int = 0) -> dict[str, int]:
    """The manifest's counts; every document is kept, filtered, removed as a duplicate or rejected exactly once
    (checked)."""
    out = {
        "files_in": files, "documents_in": n_docs, "documents_out": n_split["train"] + n_split["validation"],
        "train_documents": n_split["train"], "validation_documents": n_split["validation"],
        "exact_duplicates_removed": n_exact, "near_duplicates_removed": n_near, "rejected": n_rejected,
        "filtered": n_filtered,
        "exact_clusters": len(picture.exact_group_sizes), "near_clusters": len(picture.near_cluster_sizes),
        "candidate_buckets": len(picture.bucket_sizes), "candidate_pairs": len(picture.candidate_similarity),
        "near_pairs_confirmed": n_confirmed,
    }
    accounted = out["documents_out"] + n_exact + n_near + n_rejected + n_filtered
    if accounted != n_docs:
        raise RuntimeError(f"corpus stage lost documents: {n_docs} in, {accounted} accounted for")
    return out


def build(cfg: CorpusConfig, sources: Sequence[tuple[str, int, int]], counts: dict[str, int],
          timings: dict[str, float], text_bytes: int, bands: int, rows: int, max_bucket: int) -> dict:
    """report.json's body, less the dedup picture (`write` adds it)."""
    return {
        "counts": counts, "timings": timings, "config": asdict(cfg),
        "bytes": {"files_in": sum(size for _, size, _ in sources), "text_in": text_bytes},
        "lsh": {"num_perm": cfg.num_perm, "bands": bands, "rows": rows, "threshold": cfg.threshold,
                "shingle": cfg.shingle, "shingle_size": cfg.shingle_size, "max_bucket": max_bucket},
    }


def write(out: Path, report: dict, picture: DedupPicture, exact: pa.Table, edges: pa.Table,
          snippets: dict[str, str]) -> tuple[str, ...]:
    """report.json (with the dedup picture and the shards' bytes), examples.json and dedup.png; returns their names."""
    shards = {f"parquet_{split}": sum(f.stat().st_size for f in (out / split).glob("*.parquet"))
              for split in ("train", "validation")}
    report = {**report, "bytes": {**report.get("bytes", {}), **shards}, "dedup": picture.summary()}
    (out / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True))
    (out / EXAMPLES).write_text(json.dumps(examples(exact, edges, snippets), indent=2, ensure_ascii=False))
    plot(picture, out / PLOT)
    return REPORT, EXAMPLES, PLOT
