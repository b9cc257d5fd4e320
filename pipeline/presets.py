"""Presets are code: one function per model size, returning a complete `PipelineConfig`.

`debug` fits a 2-core laptop in minutes; the others carry the paper's numbers (Table 8 for
pretraining, Table 9 for the fine-tuning grids) for GPU clusters.
"""

from __future__ import annotations

import dataclasses

from deberta import config as model_presets
from pipeline.config import (CorpusConfig, FinetuneConfig, PipelineConfig, PretrainConfig, RayConfig,
                             TokenizeConfig, VocabConfig)

# Table 9 grids (paper appendix A.5), per model size.
GRID_1_5B = dict(dropout=(0.0, 0.15, 0.3), warmup_steps=(50, 100, 500, 1000),
                 lr=(1e-6, 3e-6, 5e-6), batch_size=(16, 32, 64))
GRID_LARGE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                  lr=(5e-6, 8e-6, 9e-6, 1e-5), batch_size=(16, 32, 48, 64))
GRID_BASE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                 lr=(1.5e-5, 2e-5, 3e-5, 4e-5), batch_size=(16, 32, 48, 64))

PIECES_128K = 128_000  # the reference 1.5B vocabulary; [MASK] is appended as id 128,000


def _with_vocab(model, pieces: int):
    """Embedding rows for `pieces` SentencePiece pieces + [MASK], padded up as the reference does."""
    return dataclasses.replace(model, vocab_size=model_presets.padded_vocab_size(pieces + 1))


def debug() -> PipelineConfig:
    """CPU-sized end to end run on the built-in news corpus: minutes on 2 cores."""
    pieces = 4_000
    return PipelineConfig(
        preset="debug",
        model=_with_vocab(model_presets.debug(), pieces),
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
        finetune=FinetuneConfig(**grid, epochs=10, max_seq_len=256, sift=sift, use_gpu=True,
                                max_concurrent_trials=8, trainer="deepspeed" if ft_workers > 1 else "torch",
                                workers_per_trial=ft_workers, zero_stage=2),
    )


def deberta_base() -> PipelineConfig:
    return _paper("deberta-base", model_presets.deberta_base(), lr=2e-4, workers=32, micro=64, zero=2,
                  grid=GRID_BASE, sift=False)


def deberta_large() -> PipelineConfig:
    return _paper("deberta-large", model_presets.deberta_large(), lr=2e-4, workers=64, micro=32, zero=2,
                  grid=GRID_LARGE, sift=False, ft_workers=2)


def deberta_1_5b() -> PipelineConfig:
    """The paper's 1.5B model: 16 nodes x 8 GPUs, ZeRO-3; fine-tuning trials of 8 DeepSpeed workers, with SiFT."""
    return _paper("deberta-1.5b", model_presets.deberta_1_5b(), lr=1.5e-4, workers=128, micro=16, zero=3,
                  grid=GRID_1_5B, sift=True, ft_workers=8)


PRESETS = {
    "debug": debug,
    "deberta-base": deberta_base,
    "deberta-large": deberta_large,
    "deberta-1.5b": deberta_1_5b,
}
