"""ALBERT's sentence-order pairs: labels are exactly "swapped", pairs never cross documents, draws are seeded;
with the tokenizer's sentence ends, both segments are whole sentences and a window of one sentence is no pair."""

import numpy as np

from stages.segment_pairs import NO_PAIR, SentenceEnds, document_rng, segment_pairs

CLS, SEP, PAD = 1, 2, 0
# a piece table: ids 0-3 special, then punctuation, then word-start pieces "▁w<id>" (unique per token below)
PUNCT = {5: ".", 6: '."', 7: '"', 8: "<0x21>", 9: "?", 10: "5", 11: ")."}
PIECES = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "<0xFF>"] + [PUNCT[i] for i in range(5, 12)] + \
         [f"\u2581w{i}" for i in range(12, 20_000)]
ENDS = SentenceEnds.of(PIECES)


def split_row(row: np.ndarray) -> tuple[list[int], list[int]]:
    """[CLS] X [SEP] Y [SEP] [PAD]... -> (X, Y)."""
    body = [int(t) for t in row if t != PAD]
    assert body[0] == CLS and body[-1] == SEP and body.count(SEP) == 2
    first_sep = body.index(SEP)
    return body[1:first_sep], body[first_sep + 1:-1]


def locate(doc: list[int], segment: list[int]) -> int:
    """Start of `segment` in `doc` (words are unique ids, so it is found once)."""
    hits = [p for p in range(len(doc) - len(segment) + 1) if doc[p:p + len(segment)] == segment]
    assert len(hits) == 1, (segment, hits)
    return hits[0]


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
    doc = _document(np.random.default_rng(0), 12)[0]
    a, b = (segment_pairs(doc, 40, CLS, SEP, PAD, document_rng(3, "d"), ENDS) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_sentence_ends_are_terminal_pieces_before_a_word_start():
    # w12 w13 . w14 ." w15 w16 . " w17 <0x21> w18 ? w19 . 5 w20 ). w21 .
    ids = np.array([12, 13, 5, 14, 6, 15, 16, 5, 7, 17, 8, 18, 9, 19, 5, 10, 20, 11, 21, 5])
    # after `.` `."` `. "` `!` `?` `).`; not inside `.5` (no word start follows) nor after the last piece
    assert ENDS.starts(ids).tolist() == [3, 5, 9, 11, 13, 18]
    assert ENDS.starts(ids[:1]).tolist() == []
    assert not ENDS.terminal[[0, 1, 2, 3, 4, 7, 10, 12]].any() and ENDS.closer[7] and not ENDS.closer[6]


def _document(rng: np.random.Generator, n_sentences: int, first_word: int = 12) -> tuple[list[int], list[int]]:
    """Sentences of 1-30 unique word ids, each closed by "." (or `."`); a few over 40 words. -> (ids, the start
    of every sentence)."""
    ids, starts, word = [], [], first_word
    for _ in range(n_sentences):
        n = int(rng.integers(45, 60)) if rng.random() < 0.1 else int(rng.integers(1, 30))
        starts.append(len(ids))
        ids += list(range(word, word + n)) + [int(rng.choice([5, 6]))]
        word += n
    return ids, starts


def test_sentence_pairs_are_whole_sentences_and_one_sentence_is_no_pair():
    rng = np.random.default_rng(0)
    max_len, labels_seen = 40, []
    for d in range(30):
        doc, starts = _document(rng, int(rng.integers(1, 25)), first_word=12 + 600 * d)
        bounds = set(starts) | {len(doc)}
        rows, lengths, labels = segment_pairs(doc, max_len, CLS, SEP, PAD, document_rng(0, f"doc{d}"), ENDS)
        covered = []
        for row, length, label in zip(rows, lengths, labels):
            body = [int(t) for t in row[:length]]
            assert (row[length:] == PAD).all() and body[0] == CLS and body[-1] == SEP
            if label == NO_PAIR:  # [CLS] one sentence (or a part of one longer than the budget) [SEP]
                assert body.count(SEP) == 1
                start = locate(doc, body[1:-1])
                end = start + len(body) - 2
                sentence = max(b for b in bounds if b <= start), min(b for b in bounds if b >= end)
                assert not [b for b in bounds if start < b < end]  # within one sentence
                assert sentence == (start, end) or sentence[1] - sentence[0] > max_len - 3, body
                covered.append((start, end))
                continue
            x, y = split_row(row)
            first, second = (y, x) if label == 1 else (x, y)
            a, b = locate(doc, first), locate(doc, second)
            assert b == a + len(first)  # in order, A then B: consecutive text of this document
            assert {a, b, b + len(second)} <= bounds  # both segments begin and end at sentence boundaries
            assert (x[0] > y[0]) == bool(label)  # swapped exactly when B comes first
            covered.append((a, b + len(second)))
            labels_seen.append(int(label))
        # the windows tile the document in order (only a window of fewer than 2 tokens is dropped)
        gaps = [(e0, s1) for (_, e0), (s1, _) in zip(covered, covered[1:]) if e0 != s1]
        assert all(s1 - e0 < 2 for e0, s1 in gaps), gaps
    assert labels_seen and 0.35 < np.mean(labels_seen) < 0.65


def test_lone_sentences_and_long_sentences_make_no_pair():
    # two sentences of 30 words: they do not fit one 40-token row together, so each is a row of its own
    two = list(range(12, 42)) + [5] + list(range(42, 72)) + [5]
    rows, lengths, labels = segment_pairs(two, 40, CLS, SEP, PAD, document_rng(0, "d"), ENDS)
    assert labels.tolist() == [NO_PAIR, NO_PAIR] and lengths.tolist() == [33, 33]
    # a 100-word sentence: budget-long parts of it, none a pair, and no short sentence joins its last part
    long = list(range(12, 112)) + [5] + list(range(112, 117)) + [5] + list(range(117, 122)) + [5]
    rows, lengths, labels = segment_pairs(long, 40, CLS, SEP, PAD, document_rng(0, "d"), ENDS)
    assert labels.tolist() == [NO_PAIR, NO_PAIR, NO_PAIR, 0] or labels.tolist() == [NO_PAIR, NO_PAIR, NO_PAIR, 1]
    assert lengths.tolist()[:3] == [39, 39, 29] and lengths[3] == 3 + 12


def _coded_shards(tmp_path, seq_len: int = 16) -> tuple[list[str], int]:
    """Two segment-pair shards of several record batches whose rows carry their own label: the token after [CLS]
    is 100 + sop_label (99 for no pair), so any reordering of one column against the other shows."""
    import pyarrow as pa

    rng, files, total = np.random.default_rng(0), [], 0
    for f, n in enumerate((700, 333)):
        labels = rng.choice(np.array([0, 1, NO_PAIR], dtype=np.int8), size=n)
        rows = rng.integers(200, 900, size=(n, seq_len)).astype(np.uint32)  # (n, T)
        rows[:, 0], rows[:, 1] = CLS, np.where(labels == NO_PAIR, 99, 100 + labels)
        ids = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), type=pa.uint32()), seq_len)
        path = tmp_path / f"part-{f}.arrow"
        table = pa.table({"input_ids": ids, "sop_label": pa.array(labels, type=pa.int8())})
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table, max_chunksize=300)
        files.append(str(path))
        total += n
    return files, total


def _check_aligned(batch) -> int:
    import torch

    labels, coded = batch["sop_labels"], batch["input_ids"][:, 1]
    assert labels.dtype == coded.dtype == torch.int64 and labels.shape == coded.shape
    assert ((coded - 100 == labels) | ((coded == 99) & (labels == NO_PAIR))).all()
    return len(labels)


def test_labels_stay_with_their_rows_through_the_pretraining_reader(tmp_path):
    """The pretraining loop's reading (stages.pretrain.data rows by index -> the objective's batch, and the validation sample)
    hands every row its own sop_label."""
    from deberta.config import debug
    from core.config import PretrainConfig
    import stages.pretrain.data as data
    from stages.pretrain import objective_for
    from stages.pretrain.loop import LoopJob, validation_batches
    from training.deepspeed_config import build_deepspeed_config

    files, total = _coded_shards(tmp_path)
    cfg = PretrainConfig(num_workers=2, micro_batch_size=8, train_batch_size=16, sop=True, eval_batches=20)
    objective = objective_for(cfg)
    split, seen = data.Sequences(files, objective.shard_columns), 0
    for rank in range(2):
        for columns in data.rank_batches(split, cfg.seed, 1, rank, 2, 8):
            seen += _check_aligned(objective.batch(columns))
    assert seen == 2 * 8 * data.batches_per_epoch(total, 2, 8) > total * 0.95  # shuffled, nearly every row
    job = LoopJob(cfg=cfg, objective=objective, model=debug(), ds_config=build_deepspeed_config(cfg, 2, False), seq_len=16, train_files=tuple(files), val_files=tuple(files),
                  tokenizer_len=1000, mask_id=999, special_ids=(0, 1, 2, 3), word_start=b"", train_flops_per_token=0.0,
                  tracker=None)
    for rank in range(2):
        batches = validation_batches(job, rank, 2)
        assert len(batches) == cfg.eval_batches and sum(_check_aligned(b) for b in batches) == 20 * 8
