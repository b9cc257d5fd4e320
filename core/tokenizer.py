"""The tokenizer every stage after `vocab` reads: a SentencePiece model plus [MASK].

Id layout, as in the reference deberta-v2-xxlarge: [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 are SentencePiece's own
pad/bos/eos/unk control pieces, so their ids are fixed by construction; the other `vocab_size - 4` pieces are
learned (256 of them are the byte-fallback pieces <0x00>..<0xFF>, ids 4..259). [MASK] is appended after them as
id `vocab_size`, outside the SentencePiece model: the tokenizer's length is `vocab_size + 1` (1.5B: 128,001).

A vocab artifact directory holds MODEL_FILE (the SentencePiece model), VOCAB_FILE (its piece list) and
SPECIAL_FILE (the special ids as JSON). This module imports only sentencepiece and numpy (never torch), so Ray
data workers can load it cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import sentencepiece as spm

from core.artifacts import MANIFEST, file_digest
from core.errors import StageInputError

PAD, CLS, SEP, UNK, MASK = "[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"
FIXED_IDS = {PAD: 0, CLS: 1, SEP: 2, UNK: 3}
MODEL_FILE, VOCAB_FILE, SPECIAL_FILE = "spm.model", "spm.vocab", "special_tokens.json"


class Tokenizer:
    """A trained vocabulary: SentencePiece pieces plus [MASK] appended as id `vocab_size`.

    Pickles as its model bytes, so it can be passed to Ray workers without a shared filesystem.
    """

    pad_id, cls_id, sep_id, unk_id = FIXED_IDS[PAD], FIXED_IDS[CLS], FIXED_IDS[SEP], FIXED_IDS[UNK]

    def __init__(self, model_bytes: bytes, source: str = "<bytes>"):
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(model_bytes)
        except RuntimeError:
            sp = None
        if sp is None or sp.vocab_size() <= len(FIXED_IDS):
            raise StageInputError(f"SentencePiece model {source} is corrupt (it does not parse); delete the vocab "
                                  f"artifact directory that holds it so the pipeline retrains it")
        found = {sp.id_to_piece(i): i for i in range(len(FIXED_IDS))}
        if found != FIXED_IDS:
            raise StageInputError(f"SentencePiece model {source} has special ids {found}, expected {FIXED_IDS}; "
                                  f"it was not trained by this pipeline's vocab stage - retrain it")
        self._sp = sp
        self._bytes = model_bytes
        self.vocab_size = sp.vocab_size()
        """SentencePiece pieces, [PAD] [CLS] [SEP] [UNK] included."""
        self.mask_id = self.vocab_size

    @classmethod
    def load(cls, path: Path | str) -> "Tokenizer":
        """From a vocab artifact directory (checked against its manifest digest when present) or a .model file."""
        path = Path(path)
        model = path / MODEL_FILE if path.is_dir() else path
        if not model.is_file():
            raise StageInputError(f"no SentencePiece model at {model}; run the vocab stage (or pass its artifact)")
        manifest = model.parent / MANIFEST
        if manifest.is_file():
            expected = json.loads(manifest.read_text()).get("files", {}).get(MODEL_FILE, {}).get("sha256")
            if expected and file_digest(model) != expected:
                raise StageInputError(f"SentencePiece model {model} is corrupt (sha256 differs from {manifest}); "
                                      f"delete {model.parent} so the pipeline retrains it")
        return cls(model.read_bytes(), str(model))

    def __reduce__(self):
        return (Tokenizer, (self._bytes, "<pickled>"))

    def __len__(self) -> int:
        return self.vocab_size + 1

    @property
    def special_ids(self) -> dict[str, int]:
        return {**FIXED_IDS, MASK: self.mask_id}

    def encode(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of each text (no [CLS]/[SEP] added). num_threads=1 keeps one worker on one core."""
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode takes a list of texts; wrap a single text as [text]")
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def encode_arrays(self, texts: Sequence[str], num_threads: int = 1) -> list[np.ndarray]:
        """Like `encode`, as (n_i,) int32 arrays: no Python int per token (about 1.4x faster for bulk work)."""
        if isinstance(texts, str):
            raise TypeError("Tokenizer.encode_arrays takes a list of texts; wrap a single text as [text]")
        return self._sp.encode_as_numpy(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
        """Text of one id sequence (or a list of them); special tokens, [MASK] included, are dropped."""
        if len(ids) and not isinstance(ids[0], (int, np.integer)):
            return [self.decode(row) for row in ids]
        return self._sp.decode([int(i) for i in ids if i < self.vocab_size])

    def normalize(self, text: str) -> str:
        """The text as decode(encode(text)) returns it: NFKC, whitespace runs collapsed, no edge spaces."""
        return self._sp.normalize(text).replace("\u2581", " ").strip(" ")

    def pieces(self) -> list[str]:
        """Piece string of every id, [MASK] last (len == len(self)); "\u2581" marks a word start."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)] + [MASK]

    def word_start_mask(self) -> np.ndarray:
        """(len(self),) bool: True where a piece begins a word or is special, for whole-word masking."""
        starts = np.array([p.startswith("\u2581") for p in self.pieces()], dtype=bool)
        starts[list(self.special_ids.values())] = True
        return starts

    def byte_mask(self) -> np.ndarray:
        """(len(self),) bool: True for the byte-fallback pieces <0x00>..<0xFF>."""
        return np.array([self._sp.is_byte(i) for i in range(self.vocab_size)] + [False], dtype=bool)
