"""Dedup's partition and driver steps without Ray: buckets, the candidate graph, routing, confirmation,
components. Each is checked against a direct (quadratic or Python-set) computation of the same thing."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from stages.corpus import dedup


def band_table(docs: list[tuple[int, int, list[int]]], bands: int) -> dict[str, np.ndarray]:
    """Band rows of documents given as (id, text hash, band keys)."""
    rows = {"part": [], "key": [], "band": [], "id_hi": [], "id_lo": [], "h_hi": [], "h_lo": []}
    for doc, text_hash, keys in docs:
        for band, key in enumerate(keys[:bands]):
            for name, value in zip(rows, (0, key, band, 0, doc, 0, text_hash)):
                rows[name].append(value)
    types = {"part": np.int32, "band": np.uint8}
    return {k: np.array(v, dtype=types.get(k, np.uint64)) for k, v in rows.items()}


def pairs_of(out: dict[str, np.ndarray], kind: int) -> set[tuple[int, int]]:
    sel = out["kind"] == kind
    return set(zip(out["a_lo"][sel].tolist(), out["b_lo"][sel].tolist()))


def test_buckets_find_exact_groups_and_pair_only_their_survivors():
    docs = [(7, 100, [1, 2]), (3, 100, [1, 2]), (5, 100, [1, 2]),  # three exact copies: 3 survives
            (9, 200, [1, 50]),  # shares band 0 with the copies
            (4, 300, [60, 2]),  # shares band 1 with the copies
            (8, 400, [70, 80])]  # alone
    out = dedup.buckets(band_table(docs, 2))
    assert pairs_of(out, dedup.EXACT) == {(3, 5), (3, 7)}  # (kept, removed), once (band 0 only)
    assert pairs_of(out, dedup.PAIR) == {(3, 9), (3, 4)}  # copies collapsed to their survivor
    assert sorted(out["size"][out["kind"] == dedup.BUCKET].tolist()) == [2, 2]


@pytest.mark.parametrize("members", [300, 256])  # 256: four chunks, a power of two
def test_oversized_buckets_are_chunked_and_chunks_differ_by_band(members):
    docs = [(i, 1000 + i, [1, 2]) for i in range(members)]  # one bucket in both bands
    out = dedup.buckets(band_table(docs, 2), max_bucket=64)
    pairs = out["kind"] == dedup.PAIR
    assert pairs.sum() < 2 * (members * (members - 1) / 2) / 3  # per band, a fraction of the bucket's pairs
    band0 = pairs_of(dedup.buckets(band_table(docs, 1), max_bucket=64), dedup.PAIR)
    assert band0 < pairs_of(out, dedup.PAIR)  # band 1 chunks the bucket differently: pairs band 0 separated
    assert all(a < b for a, b in pairs_of(out, dedup.PAIR))


def test_candidate_graph_deduplicates_pairs_seen_in_several_bands():
    hi = np.zeros(5, np.uint64)
    nodes, a, b = dedup.candidate_graph(np.stack([hi, np.array([5, 5, 2, 9, 2], np.uint64), hi,
                                                  np.array([9, 9, 5, 11, 5], np.uint64)]))
    assert nodes.lo.tolist() == [2, 5, 9, 11]
    assert list(zip(a.tolist(), b.tolist())) == [(0, 1), (1, 2), (2, 3)]
    assert nodes.doc_ids(np.array([0])).to_pylist() == [f"{0:016x}{2:016x}"]


def test_connected_components_label_each_node_with_its_smallest_member():
    rng = np.random.default_rng(0)
    n = 300
    a, b = rng.integers(0, n, 250), rng.integers(0, n, 250)
    labels = dedup.connected_components(a, b, n)
    adjacency = {i: set() for i in range(n)}
    for x, y in zip(a.tolist(), b.tolist()):
        adjacency[x].add(y)
        adjacency[y].add(x)
    for start in range(n):  # breadth-first search from every node
        seen, frontier = {start}, [start]
        while frontier:
            frontier = [y for x in frontier for y in adjacency[x] if y not in seen]
            seen.update(frontier)
        assert labels[start] == min(seen)


def test_route_keeps_small_components_whole_and_spreads_big_ones():
    # component {0..3} (small), component {4..204} (a star: big, its hub past MAX_FAN), pairs a < b,
    # component {205..256} (big: a chain, whose end 244 is the first of 12 pairs, not a hub)
    a = np.array([0, 1, 2] + [4] * 200 + list(range(205, 244)) + [244] * 12)
    b = np.array([1, 2, 3] + list(range(5, 205)) + list(range(206, 245)) + list(range(245, 257)))
    nodes = dedup.Nodes(np.zeros(257, np.uint64), np.arange(257, dtype=np.uint64))
    routes = dedup.route(nodes, a, b, parts=4, max_component=10)
    assert 200 > dedup.MAX_FAN
    seen = []
    for part, (sa, sb) in enumerate(routes.pair_slots):
        assert (routes.part[sa] == part).all() and (routes.part[sb] == part).all()  # both ends routed there
        seen += list(zip(routes.node[sa].tolist(), routes.node[sb].tolist()))
    assert sorted(seen) == sorted(zip(a.tolist(), b.tolist()))  # every pair confirmed exactly once
    assert len(set(routes.part[np.isin(routes.node, [0, 1, 2, 3])])) == 1
    star = (routes.node >= 4) & (routes.node <= 204)
    assert len(set(routes.part[star])) > 1 and (routes.node == 4).sum() > 1  # the hub goes everywhere
    chain = routes.node >= 205  # by first document: each one is in its own partition and at most one other
    assert len(set(routes.part[chain])) > 1 and np.bincount(routes.node[chain]).max() <= 2
    assert (routes.node == 244).sum() <= 2  # its 12 pairs in its own partition, not in every one


def test_route_rows_send_each_candidate_document_to_its_partitions():
    nodes = dedup.Nodes(np.array([0, 0, 1], np.uint64), np.array([3, 8, 2], np.uint64))
    routes = dedup.Routes(node=np.array([0, 1, 1, 2]), part=np.array([1, 0, 1, 0]), pair_slots=[])
    first, count = np.array([0, 1, 3]), np.array([1, 2, 1])
    batch = pa.table({"id_hi": np.array([0, 1, 0, 0], np.uint64), "id_lo": np.array([8, 2, 5, 3], np.uint64),
                      "text": ["eight", "two", "five", "three"]})
    rows = dedup.route_rows(batch, nodes.hi, nodes.lo, first, count, routes.part)
    assert sorted(zip(rows.column("text").to_pylist(), rows.column("slot").to_pylist(),
                      rows.column("part").to_pylist())) == [("eight", 1, 0), ("eight", 2, 1), ("three", 0, 1),
                                                            ("two", 3, 0)]


def test_confirm_computes_exact_jaccard_of_every_pair_and_returns_no_text():
    texts = ["the quick brown fox jumps over the lazy dog", "the quick brown fox jumps over the lazy cat",
             "something else entirely, unrelated"]
    rows = pa.table({"part": pa.array([2, 2, 2], pa.int32()), "slot": [12, 10, 11], "text": texts})
    params = dedup.Params(bands=20, shingle="char", shingle_size=5, threshold=0.7)
    out = dedup.confirm(rows, np.array([12, 12]), np.array([10, 11]), params)

    def exact(x: str, y: str) -> float:
        sx, sy = ({s[i:i + 5] for i in range(len(s) - 4)} for s in (x, y))
        return len(sx & sy) / len(sx | sy)

    assert out.column("similarity").to_pylist() == pytest.approx([exact(texts[0], texts[1]),
                                                                  exact(texts[0], texts[2])], abs=1e-12)
    assert out.column_names == ["slot_a", "slot_b", "similarity"]  # the driver holds no text per pair
    assert out.column("slot_a").to_pylist() == [12, 12] and out.column("slot_b").to_pylist() == [10, 11]
    with pytest.raises(RuntimeError, match="routing bug"):
        dedup.confirm(rows, np.array([12]), np.array([99]), params)


def test_components_pick_smallest_id_whatever_the_edge_order():
    edges = [("b", "c", 0.8), ("c", "d", 0.9), ("a", "d", 0.75), ("x", "y", 0.95)]
    results = []
    for perm in itertools.permutations(range(4)):
        rows = [edges[k] for k in perm]
        table = pa.table({"a": [r[0] for r in rows], "b": [r[1] for r in rows], "similarity": [r[2] for r in rows]},
                         schema=dedup.EDGE_SCHEMA)
        out = dedup.components(table)
        results.append(dict(zip(out.column("doc_id").to_pylist(),
                                zip(out.column("kept_doc_id").to_pylist(), out.column("similarity").to_pylist()))))
    assert all(r == results[0] for r in results)
    # direct similarity to the survivor when confirmed (d-a), else the best confirmed neighbour
    assert results[0] == {"b": ("a", 0.8), "c": ("a", 0.9), "d": ("a", 0.75), "y": ("x", 0.95)}


def test_find_handles_absent_ids_and_shared_top_bits():
    hi = np.array([1, 1, 1, 4], np.uint64)
    lo = np.array([2, 5, 9, 0], np.uint64)
    got = dedup.find(hi, lo, np.array([1, 1, 4, 2, 1], np.uint64), np.array([9, 3, 0, 0, 2], np.uint64))
    assert got.tolist() == [2, -1, 3, -1, 0]
    assert dedup.find(hi[:0], lo[:0], hi, lo).tolist() == [-1] * 4
