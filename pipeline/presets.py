"""Presets are code: one function per model size, returning a complete `PipelineConfig`.

`debug` fits a 2-core laptop in minutes; the others carry the paper's numbers (Table 8 for
pretraining, Table 9 for the fine-tuning grids) for GPU clusters. The model shapes are SPEC.md's
(1.5B = the reference `deberta-v2-xxlarge`); `deberta.config` builds the model from them.
"""

from __future__ import annotations

import dataclasses
import math

from pipeline.config import (CorpusConfig, FinetuneConfig, ModelConfig, PipelineConfig, PretrainConfig, RayConfig,
                             TokenizeConfig, VocabConfig)

# Model shapes (SPEC.md). vocab_size is set per preset from its vocabulary (`_with_vocab`).
MODEL_1_5B = ModelConfig(vocab_size=128_100, hidden_size=1536, num_hidden_layers=48, num_attention_heads=24,
                         intermediate_size=6144, position_buckets=256, share_att_key=True, conv_kernel_size=3)
"""48 x 1536, 24 heads, 256 log buckets over 512, shared position/content projections, conv beside layer 1."""
MODEL_LARGE = ModelConfig(vocab_size=128_100, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                          intermediate_size=4096)
"""24 x 1024, 16 heads, k = 512 without buckets, separate position projections."""
MODEL_BASE = ModelConfig(vocab_size=128_100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072)
"""12 x 768, 12 heads, k = 512 without buckets, separate position projections."""
MODEL_DEBUG = ModelConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                          intermediate_size=256, max_position_embeddings=128, position_buckets=16,
                          share_att_key=True, conv_kernel_size=3)
"""CPU-sized, shaped like the 1.5B (log buckets scaled to 16 over 128 positions, shared keys, conv)."""
MODELS = {"debug": MODEL_DEBUG, "deberta-base": MODEL_BASE, "deberta-large": MODEL_LARGE, "deberta-1.5b": MODEL_1_5B}

# Table 9 grids (paper appendix A.5), per model size.
GRID_1_5B = dict(dropout=(0.0, 0.15, 0.3), warmup_steps=(50, 100, 500, 1000),
                 lr=(1e-6, 3e-6, 5e-6), batch_size=(16, 32, 64))
GRID_LARGE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                  lr=(5e-6, 8e-6, 9e-6, 1e-5), batch_size=(16, 32, 48, 64))
GRID_BASE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                 lr=(1.5e-5, 2e-5, 3e-5, 4e-5), batch_size=(16, 32, 48, 64))

PAPER_SEEDS = (0, 1, 2, 3, 4)
"""The paper reports the mean over 5 runs with different seeds (appendix A.10); selection uses that mean."""
PIECES_128K = 128_000  # the reference 1.5B vocabulary; [MASK] is appended as id 128,000


def _with_vocab(model: ModelConfig, pieces: int) -> ModelConfig:
    """Embedding rows for `pieces` SentencePiece pieces + [MASK], padded up to a multiple of 100 as the
    reference does (128,001 -> 128,100); `deberta.config.padded_vocab_size` is the library's version."""
    return dataclasses.replace(model, vocab_size=math.ceil((pieces + 1) / 100) * 100)


def debug() -> PipelineConfig:
    """CPU-sized end to end run on the built-in news corpus: minutes on 2 cores."""
    pieces = 4_000
    return PipelineConfig(
        preset="debug",
        model=_with_vocab(MODEL_DEBUG, pieces),
        corpus=CorpusConfig(rows_per_shard=2_000),
        vocab=VocabConfig(vocab_size=pieces, sample_documents=20_000),
        tokenize=TokenizeConfig(max_seq_len=128, batch_size=128, rows_per_shard=20_000),
        pretrain=PretrainConfig(num_workers=2, micro_batch_size=8, train_batch_size=16, lr=5e-4,
                                warmup_steps=50, max_steps=800, eval_interval=200, eval_batches=8,
                                ckpt_interval=200, log_interval=50),
        finetune=FinetuneConfig(task="rotten-tomatoes", dropout=(0.0, 0.1), warmup_steps=(50,),
                                lr=(1e-3, 2e-3), batch_size=(32,), epochs=3, max_seq_len=64,
                                max_train_examples=2_000, max_concurrent_trials=2),
        # Ray CPUs are scheduling slots: the 2 training workers hold one each for the whole run,
        # and the Ray Data tasks streaming their shards need slots of their own.
        ray=RayConfig(num_cpus=4),
    )


def _paper(name: str, model, lr: float, workers: int, micro: int, zero: int, grid: dict, sift: bool,
           ft_workers: int = 1) -> PipelineConfig:
    """Table 8 schedule: 2,048 x 512-token sequences per step, 10k warmup, 1M steps, AdamW."""
    return PipelineConfig(
        preset=name,
        model=_with_vocab(model, PIECES_128K),
        vocab=VocabConfig(vocab_size=PIECES_128K, sample_documents=10_000_000),
        tokenize=TokenizeConfig(max_seq_len=512),
        pretrain=PretrainConfig(num_workers=workers, use_gpu=True, cpus_per_worker=8, zero_stage=zero,
                                micro_batch_size=micro, train_batch_size=2_048, lr=lr, warmup_steps=10_000,
                                max_steps=1_000_000, eval_interval=5_000, ckpt_interval=5_000, log_interval=10),
        finetune=FinetuneConfig(**grid, epochs=10, max_seq_len=256, sift=sift, use_gpu=True, seeds=PAPER_SEEDS,
                                max_concurrent_trials=8, trainer="deepspeed" if ft_workers > 1 else "torch",
                                workers_per_trial=ft_workers, zero_stage=2),
    )


def deberta_base() -> PipelineConfig:
    return _paper("deberta-base", MODEL_BASE, lr=2e-4, workers=32, micro=64, zero=2,
                  grid=GRID_BASE, sift=False)


def deberta_large() -> PipelineConfig:
    return _paper("deberta-large", MODEL_LARGE, lr=2e-4, workers=64, micro=32, zero=2,
                  grid=GRID_LARGE, sift=False, ft_workers=2)


def deberta_1_5b() -> PipelineConfig:
    """The paper's 1.5B model: 16 nodes x 8 GPUs, ZeRO-3; fine-tuning trials of 8 DeepSpeed workers, with SiFT."""
    return _paper("deberta-1.5b", MODEL_1_5B, lr=1.5e-4, workers=128, micro=16, zero=3,
                  grid=GRID_1_5B, sift=True, ft_workers=8)


PRESETS = {
    "debug": debug,
    "deberta-base": deberta_base,
    "deberta-large": deberta_large,
    "deberta-1.5b": deberta_1_5b,
}
