"""Vocab stage: a SentencePiece model trained on a deterministic sample of the corpus's train split.

The id layout ([PAD] [CLS] [SEP] [UNK] = 0..3 as SentencePiece control pieces, [MASK] appended as id
`vocab_size`) is fixed at training time here and read back by `core.tokenizer.Tokenizer`.

Sample: doc ids are hashed with a seeded SipHash (`pandas.util.hash_array`, vectorised) and the
`sample_documents` smallest hashes are kept, so the sample is exact in size and independent of file order and
sharding. Two streaming passes over the train split (the doc_id column, then the chosen texts, written one
paragraph per line to a temporary file) bound memory by the sample's hashes, never by the corpus.

Determinism: every sampled line is used (`input_sentence_size=0`, no shuffling) and the temporary paths recorded in
the model's trainer spec are replaced by fixed names. SentencePiece's EM sums per-thread partial counts, so
bit-identical models also need the same thread count (`VocabConfig.num_threads`).

Outputs: spm.model, spm.vocab, special_tokens.json (ids), stats.json (pieces, coverage, pieces per word on
validation). `core.tokenizer.Tokenizer` is how the tokenize, pretrain and finetune stages read them.

Given a checkpoint's directory instead of a corpus (its one input, under any name: continued pretraining makes the
vocab stage read `pretrain.init`, `stages.pretrain.continued.prepare`), the stage copies that checkpoint's
SentencePiece model into the same layout and trains nothing.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from core.artifacts import Artifact
from core.tokenizer import CLS, MODEL_FILE, PAD, SEP, SPECIAL_FILE, UNK, VOCAB_FILE, Tokenizer
from core.errors import StageInputError
from stages.base import StageContext, StageResult

if TYPE_CHECKING:
    from core.config import VocabConfig

VERSION = "1"

SPLITS = ("train", "validation")
STATS_FILE = "stats.json"
STATS_DOCUMENTS = 5_000  # validation documents measured for stats.json: enough for stable means, seconds to encode
READ_BATCH = 4_096  # rows per pyarrow batch when streaming the corpus


# ----------------------------------------------------------------------------------------------- corpus reading

def split_files(corpus: Artifact, split: str, columns: Sequence[str]) -> list[Path]:
    """The split's Parquet shards, checked to exist, hold `columns` and hold at least one document."""
    root = Path(corpus.path) / split
    files = sorted(root.glob("*.parquet"))
    rows = 0
    for f in files:
        try:
            meta = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises several types for a damaged footer
            raise StageInputError(f"corpus shard {f} is unreadable ({e}); rebuild the corpus artifact "
                                  f"(delete {corpus.path} and re-run)") from None
        missing = [c for c in columns if c not in meta.schema_arrow.names]
        if missing:
            raise StageInputError(f"corpus shard {f} lacks column(s) {missing}; the corpus stage writes "
                                  f"doc_id, text, source - point the stage at a corpus artifact")
        rows += meta.metadata.num_rows
    if rows == 0:
        raise StageInputError(
            f"corpus split {split!r} at {root} has no documents ({len(files)} shard(s)); add text to the corpus "
            f"or, for validation, raise corpus.validation_fraction")
    return files


def iter_batches(files: Sequence[Path], columns: Sequence[str], batch_size: int = READ_BATCH) -> Iterator[dict]:
    """Stream `columns` of the shards as {column: list} batches, in file order."""
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=list(columns)):
            yield {c: batch.column(c).to_pylist() for c in columns}


def doc_hashes(doc_ids: Sequence[str], seed: int) -> np.ndarray:
    """Seeded 64-bit SipHash of each doc_id (stable across runs, processes and machines)."""
    import pandas as pd

    key = hashlib.sha256(f"vocab-sample-{seed}".encode()).hexdigest()[:16]
    return pd.util.hash_array(np.asarray(doc_ids, dtype=object), hash_key=key, categorize=False)


def sample_threshold(files: Sequence[Path], k: int, seed: int) -> int:
    """Largest hash among the k smallest doc_id hashes: documents at or below it form the sample."""
    kept = np.empty(0, dtype=np.uint64)
    for batch in iter_batches(files, ["doc_id"]):
        kept = np.concatenate([kept, doc_hashes(batch["doc_id"], seed)])
        if len(kept) > k:
            kept = np.partition(kept, k - 1)[:k]
    return int(kept.max())


def write_sample(files: Sequence[Path], threshold: int, seed: int, max_bytes: int, dest: Path) -> tuple[int, int]:
    """Write the sampled documents, one non-empty paragraph per line; returns (documents, lines).

    Lines longer than SentencePiece's `max_sentence_length` would be skipped by the trainer, so they are cut
    into pieces of at most max_bytes // 4 characters (UTF-8 needs at most 4 bytes per character).
    """
    docs = lines = 0
    step = max(1, max_bytes // 4)
    with open(dest, "w", encoding="utf-8") as out:
        for batch in iter_batches(files, ["doc_id", "text"]):
            chosen = np.flatnonzero(doc_hashes(batch["doc_id"], seed) <= np.uint64(threshold))
            for i in chosen:
                docs += 1
                for line in (batch["text"][i] or "").splitlines():
                    line = line.strip()
                    for start in range(0, len(line), step):
                        out.write(line[start:start + step] + "\n")
                        lines += 1
    return docs, lines


# ----------------------------------------------------------------------------------------------- the stage

def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def train_model(cfg: VocabConfig, sample: Path, out: Path, num_threads: int) -> None:
    """Train into out/spm.model + out/spm.vocab; rephrase SentencePiece's errors a user can fix."""
    try:
        spm.SentencePieceTrainer.train(
            input=str(sample), model_prefix=str(out / "spm"), model_type=cfg.model_type,
            vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage, byte_fallback=True,
            pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece=PAD, bos_piece=CLS, eos_piece=SEP, unk_piece=UNK,
            input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=cfg.max_sentence_length,
            num_threads=num_threads, minloglevel=1,
        )
    except RuntimeError as e:
        limit = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if limit:
            raise StageInputError(
                f"vocab.vocab_size={cfg.vocab_size} is larger than the sampled train text supports (at most "
                f"{limit.group(2)} pieces); lower vocab.vocab_size, or raise vocab.sample_documents / add text"
            ) from None
        raise StageInputError(f"SentencePiece training failed for vocab.vocab_size={cfg.vocab_size}, "
                              f"model_type={cfg.model_type}: {str(e).strip()}") from None
    # The trainer spec records the temporary input path and prefix; fixed names keep the bytes reproducible.
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((out / MODEL_FILE).read_bytes())
    del proto.trainer_spec.input[:]
    proto.trainer_spec.input.append("train-sample.txt")
    proto.trainer_spec.model_prefix = "spm"
    (out / MODEL_FILE).write_bytes(proto.SerializeToString())


def validation_stats(tok: Tokenizer, files: Sequence[Path], num_threads: int) -> dict[str, float]:
    """Pieces per word, byte-fallback and [UNK] shares, character coverage and round-trip rate on validation."""
    is_byte = tok.byte_mask()
    vocab_chars = {c for p, b in zip(tok.pieces()[:tok.vocab_size], is_byte) if not b for c in p} - {"\u2581"}
    docs = words = pieces = byte_pieces = unk = exact = 0
    chars: collections.Counter[str] = collections.Counter()
    for batch in iter_batches(files, ["text"], batch_size=256):
        texts = [t or "" for t in batch["text"]][:STATS_DOCUMENTS - docs]
        ids = tok.encode(texts, num_threads=num_threads)
        for text, row, decoded in zip(texts, ids, tok.decode(ids) if ids else []):
            norm = tok.normalize(text)
            words += len(norm.split())
            chars.update(norm.replace(" ", ""))
            arr = np.asarray(row, dtype=np.int64)
            pieces += len(arr)
            byte_pieces += int(is_byte[arr].sum()) if len(arr) else 0
            unk += int((arr == tok.unk_id).sum())
            exact += decoded == norm
        docs += len(texts)
        if docs >= STATS_DOCUMENTS:
            break
    total_chars = sum(chars.values())
    covered = sum(n for c, n in chars.items() if c in vocab_chars)
    return {
        "validation_documents": docs,
        "validation_words": words,
        "validation_pieces": pieces,
        "pieces_per_word": pieces / max(words, 1),
        "byte_fallback_share": byte_pieces / max(pieces, 1),
        "unk_share": unk / max(pieces, 1),
        "char_coverage": covered / max(total_chars, 1),
        "roundtrip_exact_share": exact / max(docs, 1),
    }


def copy_tokenizer(checkpoint, out: Path) -> StageResult:
    """A checkpoint's own SentencePiece model (an HF directory's spm.model), in this stage's layout (its ids are the
    ones the checkpoint was trained with: pieces 0-3 [PAD] [CLS] [SEP] [UNK], [MASK] = pieces, as released V3)."""
    shutil.copyfile(Path(checkpoint.path) / MODEL_FILE, out / MODEL_FILE)
    tok = Tokenizer.load(out / MODEL_FILE)
    (out / SPECIAL_FILE).write_text(json.dumps(tok.special_ids, indent=2) + "\n")
    stats = {"pieces": tok.vocab_size, "tokenizer_length": len(tok), "from": checkpoint.source,
             "from_digest": checkpoint.id}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return StageResult(counts={"pieces": tok.vocab_size, "tokenizer_length": len(tok)},
                       log_files=(MODEL_FILE, SPECIAL_FILE, STATS_FILE),
                       summary={"vocab": f"from {checkpoint.source}: {tok.vocab_size} pieces + [MASK]={tok.mask_id}"})


BYTE_PIECES = 256 + 4
"""Pieces a vocabulary has whatever the text: the byte-fallback pieces and [PAD] [CLS] [SEP] [UNK]."""
MAX_PIECE_CHARS = 16
"""SentencePiece's longest piece (`max_sentencepiece_length`): an n-byte text has at most 16 n distinct pieces."""


def supported_pieces(text_bytes: int) -> tuple[int, int]:
    """(certain, likely) upper bounds on the pieces SentencePiece can find in `text_bytes` of text: every piece is
    a substring of at most MAX_PIECE_CHARS; and what it found in the built-in news text (2 kB: 533, 8 kB: 633,
    32 kB: 1,742, 128 kB: 3,166, 512 kB: 6,149 pieces), which 300 + 10 sqrt(bytes) stays above."""
    return BYTE_PIECES + MAX_PIECE_CHARS * text_bytes, 300 + int(10 * text_bytes ** 0.5)


def check_inputs(cfg: VocabConfig, *, listing: dict, planned: frozenset[str]) -> list[str]:
    """Before Ray starts: a vocabulary larger than the raw corpus's text can hold is refused (SentencePiece would
    fail after the corpus stage), one it probably cannot fill is warned of. Only for plain-text corpora, whose
    listed sizes are their text's."""
    from stages.corpus.listing import text_bytes

    raw = listing.get("raw")
    size = text_bytes(raw) if raw is not None else None
    if size is None:
        return []
    certain, likely = supported_pieces(size)
    if cfg.vocab_size > certain:
        raise StageInputError(f"vocab.vocab_size={cfg.vocab_size} pieces cannot be found in a corpus of {size:,} "
                              f"bytes of text (at most {certain:,}); add text, or lower vocab.vocab_size (and "
                              f"model.vocab_size with it)")
    if cfg.vocab_size > likely:
        return [f"vocab.vocab_size={cfg.vocab_size}: a corpus of {size:,} bytes of text probably supports about "
                f"{likely:,} pieces (SentencePiece on news text of that size), and the vocab stage would then fail; "
                f"add text or lower vocab.vocab_size"]
    return []


def run(cfg: VocabConfig, *, inputs: dict[str, Artifact], out: Path, ctx: StageContext) -> StageResult:
    if "corpus" not in inputs:  # a checkpoint's directory: its tokenizer, copied
        (checkpoint,) = inputs.values()
        return copy_tokenizer(checkpoint, out)
    corpus = inputs["corpus"]
    train = split_files(corpus, "train", ["doc_id", "text"])
    validation = split_files(corpus, "validation", ["text"])
    num_threads = cfg.num_threads or available_cpus()
    threshold = sample_threshold(train, cfg.sample_documents, cfg.seed)
    ctx.scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ctx.scratch) as tmp:
        sample = Path(tmp) / "train-sample.txt"
        sampled_docs, sampled_lines = write_sample(train, threshold, cfg.seed, cfg.max_sentence_length, sample)
        if sampled_lines == 0:
            raise StageInputError(f"the train split of {corpus.path} holds only empty documents; "
                                  f"check corpus.jsonl_field / corpus.parquet_column")
        sample_bytes = sample.stat().st_size
        train_model(cfg, sample, out, num_threads)

    tok = Tokenizer.load(out / MODEL_FILE)
    special = tok.special_ids
    (out / SPECIAL_FILE).write_text(json.dumps(special, indent=2) + "\n")
    stats = {
        "pieces": tok.vocab_size,
        "tokenizer_length": len(tok),
        "byte_pieces": int(tok.byte_mask().sum()),
        "model_type": cfg.model_type,
        "character_coverage_target": cfg.character_coverage,
        "num_threads": num_threads,
        "sample_documents": sampled_docs,
        "sample_lines": sampled_lines,
        "sample_bytes": sample_bytes,
        **validation_stats(tok, validation, num_threads),
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return StageResult(
        metrics={k: float(stats[k]) for k in ("pieces_per_word", "byte_fallback_share", "unk_share",
                                              "char_coverage", "roundtrip_exact_share")},
        counts={"pieces": tok.vocab_size, "tokenizer_length": len(tok), "sample_documents": sampled_docs,
                "sample_lines": sampled_lines, "validation_documents": stats["validation_documents"]},
        log_files=(MODEL_FILE, VOCAB_FILE, SPECIAL_FILE, STATS_FILE),
        summary={"vocab": f"{tok.vocab_size} pieces + [MASK]={tok.mask_id}, "
                          f"{stats['pieces_per_word']:.2f} pieces/word on validation"},
    )
