"""Exact and near duplicates of the fingerprinted documents: two shuffles, everything else vectorised.

    docs --map_batches(band_rows)--> one row per (document, band): part, key, band, id, text hash
         --groupby(part).map_groups(buckets)--> per partition, over all its buckets at once:
              exact groups (band 0: copies share every band key), candidate pairs between
              exact survivors sharing a bucket, bucket sizes                          -> driver
    driver: candidate pairs deduplicated across bands; connected components of the candidate graph
            give each pair a confirm partition (a component stays whole unless it outgrows one)
    docs --map_batches(route_rows)--> part, slot, text for candidate documents only
         --groupby(part).map_groups(confirm)--> exact Jaccard of all the partition's pairs -> driver
    driver: connected components of the confirmed pairs only -> one survivor (smallest doc_id) each

Documents are keyed by their 128-bit id as two uint64 (id_hi, id_lo), which sort like the doc_id
strings, so "smallest doc_id" is a lexsort. Exact copies have equal signatures, hence equal keys in
every band: band 0's buckets hold every exact group whole, and in any bucket the copies collapse to
their smallest id (the exact survivor) before pairs are formed. A bucket of more than MAX_BUCKET
survivors is split by a per-band hash of the id, so pairs separated in one band meet in another.

Memory: a map task holds one batch (corpus.batch_size documents, times `bands` small rows); a bucket
partition holds ~PARTITION_BYTES of band rows plus the pairs of its buckets (at most MAX_BUCKET^2/2 per
bucket chunk); a confirm partition holds ~CONFIRM_BYTES of candidate text and its shingle sets (8 bytes
per distinct shingle); a component bigger than that is spread over partitions by the first document of
each pair (a hub's pairs one by one), its documents copied where their pairs go. Partition counts follow the data (bytes / budget, at least two
per CPU). The driver, and the tables broadcast to tasks, hold only duplicate-shaped data: exact-group
members, candidate pairs, one route entry per candidate document, confirmed pairs, the removed ids.
None of it grows with the corpus, only with its duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.corpus.ingest import hex_ids
from stages.corpus.minhash import jaccard_pairs, mix64, normalize, run_pairs, shingle_sets

MAX_BUCKET = 64
PARTITION_BYTES = 64 << 20  # band rows per bucket partition
CONFIRM_BYTES = 8 << 20  # candidate text per confirm partition (its shingle sets take ~8x that)
MAX_PARTITIONS = 1000
MAX_FAN = 64  # pairs of one document routed to its own confirm partition; a hub's further pairs are spread
BAND_ROW_BYTES = 45  # part, key, band, id (2 x u64), text hash (2 x u64)
EXACT, PAIR, BUCKET = 0, 1, 2
EDGE_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("similarity", pa.float64())])


@dataclass(frozen=True)
class Params:
    """What the Ray tasks of dedup need, picklable without the pipeline's config."""

    bands: int
    shingle: str
    shingle_size: int
    threshold: float


def partitions(nbytes: float, cpus: int, budget: int = PARTITION_BYTES) -> int:
    """Shuffle partitions of ~budget bytes, at least two per CPU so every core has work."""
    return int(min(MAX_PARTITIONS, max(2 * cpus, -(-nbytes // budget))))


def _runs(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of equal rows in sorted columns."""
    n = len(cols[0])
    new = np.ones(n, dtype=bool)
    if n:
        new[1:] = np.any([c[1:] != c[:-1] for c in cols], axis=0)
    starts = np.flatnonzero(new)
    return starts, np.diff(np.append(starts, n))


def find(table_hi: np.ndarray, table_lo: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Index of each (hi, lo) in a table sorted by (hi, lo) with distinct rows; -1 where absent."""
    left = np.searchsorted(table_hi, hi, "left")
    right = np.searchsorted(table_hi, hi, "right")
    at = np.minimum(left, max(len(table_hi) - 1, 0))
    idx = np.where((right > left) & (table_lo[at] == lo) if len(table_hi) else False, left, -1)
    for k in np.flatnonzero(right - left > 1):  # ids sharing their top 64 bits: astronomically rare
        hits = left[k] + np.flatnonzero(table_lo[left[k]:right[k]] == lo[k])
        idx[k] = hits[0] if len(hits) else -1
    return idx


# ---------------------------------------------------------------- shuffle 1: buckets


def band_rows(batch: pa.Table, bands: int, parts: int, first: int = 0, last: int | None = None) -> dict[str, np.ndarray]:
    """One row per (readable document, band of [first, last)): its bucket key, routed to partition key % parts."""
    last = bands if last is None else last
    ok = pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False)
    keys = batch.column("bands").combine_chunks().flatten().to_numpy().reshape(-1, bands)[ok][:, first:last]  # (N, b)
    cols = {c: batch.column(c).to_numpy()[ok] for c in ("id_hi", "id_lo", "h_hi", "h_lo")}
    return {"part": (keys.ravel() % np.uint64(parts)).astype(np.int32), "key": keys.ravel(),
            "band": np.tile(np.arange(first, last, dtype=np.uint8), len(keys)),
            **{c: np.repeat(v, last - first) for c, v in cols.items()}}


def _exact_groups(r: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(kept, removed) row indices of band-0 rows sharing a text hash: the smallest id is kept."""
    rows = np.flatnonzero(r["band"] == 0)
    rows = rows[np.lexsort((r["id_lo"][rows], r["id_hi"][rows], r["h_lo"][rows], r["h_hi"][rows]))]
    starts, lengths = _runs(r["h_hi"][rows], r["h_lo"][rows])
    removed = np.ones(len(rows), dtype=bool)
    removed[starts] = False
    return rows[np.repeat(starts, lengths)][removed], rows[removed]


def _bucket_pairs(r: dict[str, np.ndarray], max_bucket: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, bucket sizes): row pairs of exact survivors sharing a bucket (chunked when oversized)."""
    rows = np.lexsort((r["id_lo"], r["id_hi"], r["h_lo"], r["h_hi"], r["key"]))
    starts, _ = _runs(r["key"][rows], r["h_hi"][rows], r["h_lo"][rows])
    reps = rows[starts]  # per (bucket, text hash): the smallest id, the exact survivor
    key = r["key"][reps]
    b_starts, b_sizes = _runs(key)
    size = np.repeat(b_sizes, b_sizes)  # (reps,) members of each rep's bucket
    nchunks = -(-size // max_bucket)
    # the band goes into the hash before its final mix, so each band cuts a bucket into different chunks
    ids = r["id_lo"][reps] ^ r["id_hi"][reps] ^ mix64(r["band"][reps].astype(np.uint64), 1)
    chunk = np.where(nchunks > 1, mix64(ids, 0), 0) % nchunks.astype(np.uint64)
    order = np.lexsort((chunk, key))
    reps, key, chunk = reps[order], key[order], chunk[order]
    g_starts, g_sizes = _runs(key, chunk)
    many = g_sizes > 1
    i, j = run_pairs(g_starts[many], g_sizes[many])
    return reps[i], reps[j], b_sizes[b_sizes > 1]


def buckets(r: dict[str, np.ndarray], max_bucket: int = MAX_BUCKET) -> dict[str, np.ndarray]:
    """map_groups over one bucket partition: exact groups, candidate pairs (a < b) and bucket sizes.

    Only rows of colliding keys matter, so they are picked out with one sort before anything else.
    """
    key = r["key"]
    order = np.argsort(key, kind="stable")
    starts, lengths = _runs(key[order])
    hot = order[np.repeat(lengths > 1, lengths)]
    r = {c: v[hot] for c, v in r.items()}
    kept, removed = _exact_groups(r)
    i, j, sizes = _bucket_pairs(r, max_bucket)
    swap = (r["id_hi"][i] > r["id_hi"][j]) | ((r["id_hi"][i] == r["id_hi"][j]) & (r["id_lo"][i] > r["id_lo"][j]))
    a, b = np.where(swap, j, i), np.where(swap, i, j)
    # a pair colliding in several of this partition's bands is sent once (the driver holds every pair row)
    order = np.lexsort((r["id_lo"][b], r["id_hi"][b], r["id_lo"][a], r["id_hi"][a]))
    starts, _ = _runs(r["id_hi"][a][order], r["id_lo"][a][order], r["id_hi"][b][order], r["id_lo"][b][order])
    a, b = a[order[starts]], b[order[starts]]
    kind = np.concatenate([np.full(len(kept), EXACT), np.full(len(a), PAIR), np.full(len(sizes), BUCKET)])
    zeros = np.zeros(len(sizes), np.uint64)
    return {"kind": kind.astype(np.uint8),
            "a_hi": np.concatenate([r["id_hi"][kept], r["id_hi"][a], zeros]),
            "a_lo": np.concatenate([r["id_lo"][kept], r["id_lo"][a], zeros]),
            "b_hi": np.concatenate([r["id_hi"][removed], r["id_hi"][b], zeros]),
            "b_lo": np.concatenate([r["id_lo"][removed], r["id_lo"][b], zeros]),
            "size": np.concatenate([np.ones(len(kept) + len(a), np.int64), sizes.astype(np.int64)])}


# ---------------------------------------------------------------- driver: the candidate graph


def connected_components(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """(n,) label of each node: the smallest node index of its component (a, b: edge endpoints).

    Min-label hooking with pointer jumping, vectorised: O(log n) rounds of numpy passes over the edges.
    """
    labels = np.arange(n)
    while True:
        low = np.minimum(labels[a], labels[b])
        hooked = labels.copy()
        np.minimum.at(hooked, labels[a], low)  # hook roots onto the smaller root across each edge
        np.minimum.at(hooked, labels[b], low)
        while True:  # pointer jumping: every node straight to its root
            jumped = hooked[hooked]
            if np.array_equal(jumped, hooked):
                break
            hooked = jumped
        if np.array_equal(hooked, labels):
            return labels
        labels = hooked


@dataclass
class Nodes:
    """Distinct documents of a pair list, sorted by id: node k is (hi[k], lo[k])."""

    hi: np.ndarray
    lo: np.ndarray

    @classmethod
    def of(cls, hi: np.ndarray, lo: np.ndarray) -> tuple["Nodes", np.ndarray]:
        """The nodes of the ids (hi, lo), and each id's node index."""
        order = np.lexsort((lo, hi))
        hi, lo = hi[order], lo[order]
        starts, lengths = _runs(hi, lo)
        nodes = cls(hi[starts], lo[starts])
        del hi, lo  # only sorted copies of the caller's arrays: the ids of millions of pair rows
        index = np.empty(len(order), dtype=np.int64)
        index[order] = np.repeat(np.arange(len(starts)), lengths)
        return nodes, index

    def doc_ids(self, k: np.ndarray) -> pa.Array:
        return hex_ids(self.hi[k], self.lo[k])


def candidate_graph(pairs: np.ndarray) -> tuple[Nodes, np.ndarray, np.ndarray]:
    """Nodes and the distinct pairs (a < b, node indices) of the candidate rows of every band; `pairs` is
    (4, P): a_hi, a_lo, b_hi, b_lo. Written to hold few copies of the P rows at once (at a million documents
    they are millions): pass the array itself, not a name still bound to it, and it is freed once read."""
    p = pairs.shape[1]
    hi, lo = pairs[[0, 2]].ravel(), pairs[[1, 3]].ravel()  # a's ids, then b's
    del pairs
    nodes, index = Nodes.of(hi, lo)
    del hi, lo
    n = len(nodes.hi)
    code = index[:p] * n
    code += index[p:]
    del index
    code.sort()  # distinct pairs, sorted (np.unique, without its copies)
    keep = np.ones(len(code), dtype=bool)
    keep[1:] = code[1:] != code[:-1]
    code = code[keep]
    return nodes, code // n, code % n


@dataclass
class Routes:
    """Where each candidate pair is confirmed, and so where its documents must go.

    Entry k (sorted by node, then part) sends node `node[k]` to partition `part[k]`; pairs name
    entries ("slots"), so a confirm partition needs no lookup beyond its own rows.
    """

    node: np.ndarray
    part: np.ndarray
    pair_slots: list[tuple[np.ndarray, np.ndarray]]  # per partition: (slot_a, slot_b)


def route(nodes: Nodes, a: np.ndarray, b: np.ndarray, parts: int, max_component: int,
          labels: np.ndarray | None = None) -> Routes:
    """A component's pairs go to one partition (by a hash of its root); a bigger one's by their first document
    (a hash of it), so a document is copied only to the partitions of its neighbours with smaller ids (routed pair
    by pair, it would be copied to about as many partitions as it has pairs), except the pairs of a document
    that is the first of more than MAX_FAN: those go pair by pair, so no partition gets a hub's every neighbour.
    `labels`: the candidate graph's connected components, if already known."""
    labels = connected_components(a, b, len(nodes.hi)) if labels is None else labels
    size = np.bincount(labels, minlength=len(labels))
    spread = size[labels[a]] > max_component
    hub = np.bincount(a, minlength=len(labels))[a] > MAX_FAN
    part = np.where(~spread, mix64(labels[a].astype(np.uint64), 3),
                    np.where(hub, mix64((a * len(labels) + b).astype(np.uint64), 2), mix64(a.astype(np.uint64), 3)))
    part = part % np.uint64(parts)
    part = part.astype(np.int64)
    entries = np.unique(np.concatenate([a * parts + part, b * parts + part]))  # sorted by (node, part)
    slot_a = np.searchsorted(entries, a * parts + part)
    slot_b = np.searchsorted(entries, b * parts + part)
    by_part = np.argsort(part, kind="stable")
    cuts = np.searchsorted(part[by_part], np.arange(parts + 1))
    pair_slots = [(slot_a[by_part[cuts[p]:cuts[p + 1]]], slot_b[by_part[cuts[p]:cuts[p + 1]]]) for p in range(parts)]
    return Routes(entries // parts, entries % parts, pair_slots)


def route_rows(batch: pa.Table, nodes_hi: np.ndarray, nodes_lo: np.ndarray, first: np.ndarray,
               count: np.ndarray, part: np.ndarray) -> pa.Table:
    """Candidate documents of a batch, one row per confirm partition they are routed to: part, slot, text."""
    node = find(nodes_hi, nodes_lo, batch.column("id_hi").to_numpy(), batch.column("id_lo").to_numpy())
    rows = np.flatnonzero(node >= 0)
    n = count[node[rows]]
    doc = np.repeat(rows, n)
    slot = np.repeat(first[node[rows]], n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    return pa.table({"part": pa.array(part[slot].astype(np.int32)), "slot": pa.array(slot),
                     "text": batch.column("text").take(pa.array(doc))})


# ---------------------------------------------------------------- shuffle 2: confirm


def confirm(rows: pa.Table, slot_a: np.ndarray, slot_b: np.ndarray, params: Params) -> pa.Table:
    """One confirm partition (rows: part, slot, text): exact Jaccard of every candidate pair routed to it.

    Returns every pair's similarity (the report histograms rejected candidates too); no text: the few pairs
    the report quotes are read again once they are chosen, so the driver never holds text per confirmed pair.
    """
    part = rows.column("part")[0].as_py()
    slots = rows.column("slot").to_numpy()
    order = np.argsort(slots)
    local_a = order[np.minimum(np.searchsorted(slots[order], slot_a), len(slots) - 1)]
    local_b = order[np.minimum(np.searchsorted(slots[order], slot_b), len(slots) - 1)]
    if not (np.array_equal(slots[local_a], slot_a) and np.array_equal(slots[local_b], slot_b)):
        raise RuntimeError(f"confirm partition {part} lacks documents of its pairs (routing bug)")
    sets = shingle_sets([normalize(t) for t in rows.column("text").to_pylist()], params.shingle, params.shingle_size,
                        mixed=False)
    sim = jaccard_pairs(*sets, local_a, local_b)
    return pa.table({"slot_a": pa.array(slot_a), "slot_b": pa.array(slot_b), "similarity": pa.array(sim)})


def clusters(a: np.ndarray, b: np.ndarray, sim: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Near-duplicate removals from confirmed pairs (node indices in id order, a < b).

    Returns (removed, survivor, similarity): the survivor of a component is its smallest node; the
    similarity recorded for a removed node is its pair with the survivor when confirmed, else its
    most similar confirmed neighbour.
    """
    labels = connected_components(a, b, n)
    best = np.zeros(n)
    np.maximum.at(best, a, sim)
    np.maximum.at(best, b, sim)
    direct = np.full(n, -1.0)
    to_root = labels[b] == a  # a < b, so the root (smallest node) can only be the pair's a
    direct[b[to_root]] = sim[to_root]
    touched = np.zeros(n, dtype=bool)
    touched[a] = touched[b] = True
    removed = np.flatnonzero(touched & (labels != np.arange(n)))
    return removed, labels[removed], np.where(direct[removed] >= 0, direct[removed], best[removed])


@dataclass
class Near:
    """The near-duplicate outcome on the driver: confirmed pairs, removals, and what the report shows."""

    edges: pa.Table  # EDGE_SCHEMA, every confirmed pair, sorted by (a, b)
    removed: pa.Table  # doc_id, kept_doc_id, similarity: each removed document and its cluster's survivor
    removed_ids: tuple[np.ndarray, np.ndarray]  # (hi, lo) of the removed documents
    candidate_similarity: np.ndarray  # every candidate pair's exact Jaccard
    cluster_sizes: np.ndarray  # documents per near-duplicate cluster


NO_NEAR = pa.table({"doc_id": pa.array([], pa.string()), "kept_doc_id": pa.array([], pa.string()),
                    "similarity": pa.array([], pa.float64())})


def resolve(nodes: Nodes, pairs: pa.Table, slot_node: np.ndarray, threshold: float) -> Near:
    """Confirmed pairs (>= threshold) of the gathered confirm output -> edges, components and removals."""
    a, b = slot_node[pairs.column("slot_a").to_numpy()], slot_node[pairs.column("slot_b").to_numpy()]
    sim = pairs.column("similarity").to_numpy()
    ok = np.flatnonzero(sim >= threshold)
    ok = ok[np.lexsort((b[ok], a[ok]))]  # node order is doc_id order
    edges = pa.table({"a": nodes.doc_ids(a[ok]), "b": nodes.doc_ids(b[ok]), "similarity": sim[ok]}, schema=EDGE_SCHEMA)
    gone, survivor, similarity = clusters(a[ok], b[ok], sim[ok], len(nodes.hi))
    removed = pa.table({"doc_id": nodes.doc_ids(gone), "kept_doc_id": nodes.doc_ids(survivor),
                        "similarity": pa.array(similarity, pa.float64())})
    sizes = np.unique(survivor, return_counts=True)[1] + 1
    return Near(edges, removed, (nodes.hi[gone], nodes.lo[gone]), sim, sizes)


def components(edges: pa.Table) -> pa.Table:
    """Connected components of a confirmed-pair table (EDGE_SCHEMA, doc_id strings) ->
    doc_id, kept_doc_id, similarity for every removed document, sorted by doc_id."""
    ids = pc.unique(pa.concat_arrays([edges.column("a").combine_chunks(), edges.column("b").combine_chunks()]))
    ids = ids.take(pc.sort_indices(ids))
    a = pc.index_in(edges.column("a"), ids).to_numpy()
    b = pc.index_in(edges.column("b"), ids).to_numpy()
    sim = edges.column("similarity").to_numpy()
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    removed, survivor, similarity = clusters(lo, hi, sim, len(ids))
    return pa.table({"doc_id": ids.take(pa.array(removed)), "kept_doc_id": ids.take(pa.array(survivor)),
                     "similarity": pa.array(similarity, pa.float64())})
