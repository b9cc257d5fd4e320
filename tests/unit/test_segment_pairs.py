"""ALBERT's sentence-order pairs: labels are exactly "swapped", pairs never cross documents, draws are seeded."""

import numpy as np

from stages.segment_pairs import document_rng, segment_pairs

CLS, SEP, PAD = 1, 2, 0


def split_row(row: np.ndarray) -> tuple[list[int], list[int]]:
    """[CLS] X [SEP] Y [SEP] [PAD]... -> (X, Y)."""
    body = [int(t) for t in row if t != PAD]
    assert body[0] == CLS and body[-1] == SEP and body.count(SEP) == 2
    first_sep = body.index(SEP)
    return body[1:first_sep], body[first_sep + 1:-1]


def test_labels_are_exactly_swapped_and_pairs_are_consecutive_text_of_one_document():
    docs = {f"doc{d}": list(range(1000 * (d + 1), 1000 * (d + 1) + n)) for d, n in enumerate([5, 130, 61, 1, 300])}
    seen_labels = []
    for doc_id, ids in docs.items():
        rows, lengths, labels = segment_pairs(ids, 64, CLS, SEP, PAD, document_rng(0, doc_id))
        assert rows.dtype == np.uint32 and rows.shape[1] == 64 and len(rows) == len(labels) == len(lengths)
        for row, length, label in zip(rows, lengths, labels):
            x, y = split_row(row)
            assert length == len(x) + len(y) + 3 and x and y
            first, second = (y, x) if label == 1 else (x, y)
            window = first + second
            assert window == sorted(window) and window[-1] - window[0] == len(window) - 1  # consecutive tokens
            assert set(window) <= set(ids)  # of this document only
            assert (x[0] > y[0]) == bool(label)  # swapped exactly when B comes first
        seen_labels += list(labels)
    assert len(segment_pairs([7], 64, CLS, SEP, PAD, document_rng(0, "short"))[0]) == 0  # no pair from one token
    assert set(seen_labels) == {0, 1}
    many = [segment_pairs(list(range(50)), 64, CLS, SEP, PAD, document_rng(0, f"d{i}"))[2][0] for i in range(400)]
    assert 0.43 < np.mean(many) < 0.57  # swapped with probability 0.5


def test_draws_depend_on_seed_and_document_not_on_batching():
    ids = list(range(10, 400))
    a = segment_pairs(ids, 32, CLS, SEP, PAD, document_rng(3, "d"))
    b = segment_pairs(ids, 32, CLS, SEP, PAD, document_rng(3, "d"))
    c = segment_pairs(ids, 32, CLS, SEP, PAD, document_rng(4, "d"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
