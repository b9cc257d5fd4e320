"""Dynamic MLM masking at batch time: whole-word n-gram spans, 15%, 80/10/10 (DeBERTa A.3, span masking).

The procedure is the reference's (microsoft/DeBERTa `apps/tasks/mlm_task.py`, `NGramMaskGenerator`):
group tokens into whole words (a SentencePiece piece starting with "▁" starts a word); walk the words
in windows of n·int(1/mlm_probability) words (6n at 15%), n ~ p(n) ∝ 1/n for n <= max_ngram, with one
n-gram at a uniform offset in each window (the next window starts after the window or the n-gram,
whichever ends later); then take the picked n-grams until round(0.15 · #non-special tokens) targets
are reached. Each target becomes [MASK] (80%), a random non-special token (10%) or stays (10%). Special
tokens are never targets. Where we differ (which candidates the quota keeps, what counts as a word):
* the picked n-grams are taken in random order; the reference walks them left to right, so on rows
  with more candidates than quota (about 1/6 of words are candidates) the row's end is under-masked;
* the quota is cut at n-gram granularity: the n-gram that crosses it is taken only if that lands nearer
  the quota (always at least one n-gram); the reference stops at the first *word* that reaches it, so
  it may keep only part of the last n-gram;
* the quota counts non-special tokens; the reference's counts the row's tokens incl. [CLS]/[SEP] and is
  capped at max_preds_per_seq (80 for 512-token rows, above the 77 quota there);
* a word starts only at "▁" (or after a special token); the reference's `part_of_whole_word` also starts
  one at every one-character punctuation piece, and lets a continuation piece after a special token
  join the word before it.

Reproducible: the same (seed, step) always gives the same masks, independent of process or worker;
pass a distinct `step` per batch (e.g. global step x micro-batch index) so batches differ.

Building `word_start` from a SentencePiece model without importing sentencepiece here:

    sp = sentencepiece.SentencePieceProcessor(model_file="vocab.model")
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    word_start = word_starts_from_pieces(pieces, vocab_size=len(tokenizer))   # [MASK] etc. appended
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

IGNORE_INDEX = -100
WORD_PREFIX = "\u2581"  # "▁", SentencePiece's marker of a preceding space


def word_starts_from_pieces(pieces: Sequence[str], vocab_size: int | None = None) -> torch.Tensor:
    """(V,) bool: True where the piece begins a new word (starts with "▁").

    Ids past the pieces (appended specials such as [MASK], padded embedding rows) count as word starts.
    """
    vocab_size = len(pieces) if vocab_size is None else vocab_size
    if vocab_size < len(pieces):
        raise ValueError(f"word_starts_from_pieces: vocab_size={vocab_size} < {len(pieces)} pieces")
    starts = torch.ones(vocab_size, dtype=torch.bool)
    starts[: len(pieces)] = torch.tensor([p.startswith(WORD_PREFIX) for p in pieces], dtype=torch.bool)
    return starts


class SpanMasker:
    """Callable: `masker(input_ids (B, T), step=k)` -> (masked_input_ids (B, T), labels (B, T), -100 = no target).

    vocab_size: tokenizer length (random replacements are drawn from its non-special ids).
    mask_id: the [MASK] id. special_ids: ids never masked nor drawn ([PAD], [CLS], [SEP], [UNK], [MASK]).
    word_start: (>= vocab_size,) bool from `word_starts_from_pieces`; None = every token is a word.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_id: int,
        special_ids: Iterable[int],
        word_start: torch.Tensor | None = None,
        mlm_probability: float = 0.15,
        max_ngram: int = 3,
        seed: int = 0,
        mask_prob: float = 0.8,
        random_prob: float = 0.1,
    ):
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"SpanMasker: mlm_probability={mlm_probability} must be in (0, 1)")
        if max_ngram < 1:
            raise ValueError(f"SpanMasker: max_ngram={max_ngram} must be >= 1")
        if mask_prob + random_prob > 1.0:
            raise ValueError(f"SpanMasker: mask_prob + random_prob = {mask_prob + random_prob} > 1")
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.mlm_probability = mlm_probability
        self.max_ngram = max_ngram
        self.seed = seed
        self.mask_prob = mask_prob
        self.random_prob = random_prob
        # one candidate n-gram per window of n · int(1 / mlm_probability) words (6n at 15%), the
        # reference's `mask_window`: about 1/6 of the words are candidates for a 15% quota
        self.window_per_gram = max(1, int(1 / mlm_probability))
        special = torch.zeros(vocab_size, dtype=torch.bool)
        special[torch.tensor(sorted(set(special_ids)) + [mask_id], dtype=torch.long)] = True
        self.is_special = special
        self.replacement_ids = torch.nonzero(~special).view(-1)  # random tokens: never specials
        self.word_start = None
        if word_start is not None:
            if word_start.numel() < vocab_size:
                raise ValueError(f"SpanMasker: word_start has {word_start.numel()} entries < vocab_size={vocab_size}")
            self.word_start = word_start.to(torch.bool)
        n = torch.arange(1, max_ngram + 1, dtype=torch.float64)
        self.ngram_probs = (1.0 / n) / (1.0 / n).sum()  # p(n) ∝ 1/n

    def generator(self, step: int) -> torch.Generator:
        """The generator for batch `step`: a pure function of (seed, step)."""
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + step) % (2**63 - 1))
        return g

    def __call__(
        self, input_ids: torch.Tensor, step: int = 0, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask a batch (B, T) of token ids; `generator` (CPU) overrides the one derived from `step`."""
        if input_ids.dim() != 2:
            raise ValueError(f"SpanMasker: input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        g = generator if generator is not None else self.generator(step)
        ids = input_ids.cpu()
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"SpanMasker: token ids must lie in [0, {self.vocab_size}); got {int(ids.min())}..{int(ids.max())}")
        targets = torch.stack([self._targets(row, g) for row in ids])  # (B, T) bool
        masked, labels = self._replace(ids, targets, g)
        return masked.to(input_ids.device), labels.to(input_ids.device)

    def _words(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (word index of each non-special token (-1 for specials), token count of each word)."""
        special = self.is_special[row]  # (T,)
        starts = torch.ones_like(special) if self.word_start is None else self.word_start[row].clone()
        # a continuation piece right after a special token (e.g. after [CLS]) still starts a word
        starts[1:] |= special[:-1]
        starts[0] = True
        starts &= ~special
        word = torch.cumsum(starts.long(), 0) - 1  # (T,)
        word[special] = -1
        num_words = int(starts.sum())
        lengths = torch.bincount(word[~special], minlength=num_words)  # (W,)
        return word, lengths

    def _pick_grams(self, num_words: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of window_per_gram·n words, one n-gram each -> (starts, ends) word indices, ends exclusive."""
        # enough windows for the worst case (every window of the smallest size n = 1)
        k = num_words // self.window_per_gram + 2
        n = torch.multinomial(self.ngram_probs, k, replacement=True, generator=g) + 1  # (k,)
        u = torch.rand(k, generator=g, dtype=torch.float64)
        ctx = n * self.window_per_gram
        # the offset inside a window never depends on clipping except in the last window, so all window
        # starts follow from one cumsum: next = offset + max(ctx, m + n)
        m = torch.floor(u * ctx).long()
        step = torch.maximum(ctx, m + n)
        offset = torch.cumsum(step, 0) - step  # (k,) window starts
        live = offset < num_words
        ctx_clipped = torch.minimum(ctx, num_words - offset)
        m = torch.where(ctx_clipped < ctx, torch.floor(u * ctx_clipped.clamp(min=1)).long(), m)
        s = (offset + m)[live]
        e = torch.minimum(s + n[live], torch.tensor(num_words))
        return s, e

    def _targets(self, row: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """(T,) ids -> (T,) bool targets for one sequence."""
        word, lengths = self._words(row)
        num_tokens = int(lengths.sum())
        targets = torch.zeros_like(row, dtype=torch.bool)
        if num_tokens == 0:
            return targets
        quota = max(1, round(num_tokens * self.mlm_probability))
        s, e = self._pick_grams(lengths.numel(), g)
        perm = torch.randperm(s.numel(), generator=g)
        s, e = s[perm], e[perm]
        prefix = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])  # (W+1,)
        gram_tokens = prefix[e] - prefix[s]  # (G,)
        before = torch.cumsum(gram_tokens, 0) - gram_tokens
        # take n-grams while that brings the count nearer the quota: taking the one that crosses it
        # whole would overshoot by half an n-gram on average (18-19% on short reviews)
        take = (2 * before + gram_tokens) < 2 * quota
        take[0] = True  # at least one n-gram, even when it alone overshoots (short rows)
        chosen = torch.zeros(lengths.numel() + 1, dtype=torch.long)
        # mark word ranges [s, e) with a difference array
        chosen.index_add_(0, s[take], torch.ones_like(s[take]))
        chosen.index_add_(0, e[take], -torch.ones_like(e[take]))
        word_chosen = torch.cumsum(chosen, 0)[:-1] > 0  # (W,)
        real = word >= 0
        targets[real] = word_chosen[word[real]]
        return targets

    def _replace(
        self, ids: torch.Tensor, targets: torch.Tensor, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """80% [MASK], 10% random non-special token, 10% unchanged, at the targets."""
        labels = torch.where(targets, ids, torch.full_like(ids, IGNORE_INDEX))
        u = torch.rand(ids.shape, generator=g)
        random_tok = self.replacement_ids[
            torch.randint(0, self.replacement_ids.numel(), ids.shape, generator=g)
        ]
        masked = ids.clone()
        use_mask = targets & (u < self.mask_prob)
        use_random = targets & (u >= self.mask_prob) & (u < self.mask_prob + self.random_prob)
        masked[use_mask] = self.mask_id
        masked[use_random] = random_tok[use_random]
        return masked, labels
