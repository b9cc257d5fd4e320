"""Presets are code: one function per model size, returning a complete `PipelineConfig`.

`debug` fits a 2-core laptop in minutes; the others carry the paper's numbers (Table 8 for
pretraining, Table 9 for the fine-tuning grids) for GPU clusters. The model shapes are DeBERTa §5.1's (large,
base) and §5.3's (1.5B = the reference `deberta-v2-xxlarge`), DeBERTaV3's Table 10 and, for `debug`,
`deberta.config.debug()`: each a `deberta.config.DebertaConfig`, the [model] section as the model library reads it.
"""

from __future__ import annotations

import dataclasses

import deberta.config
from core.config import (CorpusConfig, FinetuneConfig, PipelineConfig, PretrainConfig, RayConfig, TokenizeConfig,
                         VocabConfig)
from deberta.config import DebertaConfig, padded_vocab_size

# vocab_size is set per preset from its vocabulary (`_with_vocab`).
MODEL_1_5B = DebertaConfig(vocab_size=128_100, hidden_size=1536, num_hidden_layers=48, num_attention_heads=24,
                           intermediate_size=6144, position_buckets=256, share_att_key=True, conv_kernel_size=3)
"""48 x 1536, 24 heads, 256 log buckets over 512, shared position/content projections, conv beside layer 1."""
MODEL_LARGE = DebertaConfig(vocab_size=128_100, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096)
"""24 x 1024, 16 heads, k = 512 without buckets, separate position projections."""
MODEL_BASE = DebertaConfig(vocab_size=128_100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072)
"""12 x 768, 12 heads, k = 512 without buckets, separate position projections."""
# DeBERTaV3 (its Table 10; microsoft/DeBERTa experiments/language_model/rtd_*.json): the released layout -
# 256 log buckets over 512, position projections shared with content, LayerNorm on the relative table, no conv.
_V3 = dict(vocab_size=128_100, position_buckets=256, share_att_key=True, norm_rel_ebd=True, conv_kernel_size=0)
MODEL_V3_XSMALL = DebertaConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                                **_V3)
MODEL_V3_SMALL = DebertaConfig(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072,
                               **_V3)
MODEL_V3_BASE = DebertaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                              **_V3)
MODEL_V3_LARGE = DebertaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                               **_V3)

# Table 9 grids (paper appendix A.5), per model size.
GRID_1_5B = dict(dropout=(0.0, 0.15, 0.3), warmup_steps=(50, 100, 500, 1000),
                 lr=(1e-6, 3e-6, 5e-6), batch_size=(16, 32, 64))
GRID_LARGE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                  lr=(5e-6, 8e-6, 9e-6, 1e-5), batch_size=(16, 32, 48, 64))
# DeBERTaV3 fine-tuning: Table 9's dropout/warmup/batch protocol per size; it gives no learning-rate
# range (its Table 11 is not reproduced), so each size takes Table 9's for the same size.
GRID_V3_LARGE = dict(dropout=(0.0, 0.15, 0.3), warmup_steps=(50, 100, 500, 1000),
                     lr=(5e-6, 8e-6, 9e-6, 1e-5), batch_size=(16, 32, 64))
GRID_BASE = dict(dropout=(0.0, 0.1, 0.15), warmup_steps=(50, 100, 500, 1000),
                 lr=(1.5e-5, 2e-5, 3e-5, 4e-5), batch_size=(16, 32, 48, 64))

PAPER_SEEDS = (0, 1, 2, 3, 4)
"""The paper reports the mean over 5 runs with different seeds (appendix A.10); selection uses that mean."""
PIECES_128K = 128_000  # the reference 1.5B vocabulary; [MASK] is appended as id 128,000
# The paper-size presets ingest users' web text, which every corpus of the papers was filtered from (DeBERTa A.2:
# OpenWebText, CommonCrawl Stories); English, as DeBERTa's corpora are. The CPU presets' built-in news keeps none
# (`CorpusConfig.filters` says why).
WEB_CORPUS = CorpusConfig(filters=("all",), languages=("en",))


def _with_vocab(model: DebertaConfig, pieces: int) -> DebertaConfig:
    """Embedding rows for `pieces` SentencePiece pieces + [MASK], padded up to a multiple of 100 as the
    reference does (128,001 -> 128,100)."""
    return model.replace(vocab_size=padded_vocab_size(pieces + 1))


def debug() -> PipelineConfig:
    """CPU-sized end to end run on the built-in news corpus: minutes on 2 cores."""
    pieces = 4_000
    return PipelineConfig(
        preset="debug",
        model=_with_vocab(deberta.config.debug(), pieces),
        corpus=CorpusConfig(rows_per_shard=2_000),
        vocab=VocabConfig(vocab_size=pieces, sample_documents=20_000),
        tokenize=TokenizeConfig(max_seq_len=128, batch_size=128, rows_per_shard=20_000),
        pretrain=PretrainConfig(num_workers=2, micro_batch_size=8, train_batch_size=16, lr=5e-4,
                                warmup_steps=50, max_steps=800, eval_interval=200, eval_batches=8,
                                ckpt_interval=200, log_interval=50,
                                # probes off (pretrain.probes=TASK turns them on): the debug model's settings, the
                                # finetune grid's learning rates; 250 steps are 20 epochs of 200 labels, where
                                # fine-tuning this model from scratch has converged on a sentence and a token task
                                probe_interval=200, probe_lr=(1e-3, 2e-3), probe_max_steps=250, probe_patience=5,
                                probe_max_seq_len=64),
        finetune=FinetuneConfig(task="rotten-tomatoes", dropout=(0.0, 0.1), warmup_steps=(50,),
                                lr=(1e-3, 2e-3), batch_size=(32,), epochs=3, max_seq_len=64, doc_stride=16,
                                max_train_examples=2_000, max_concurrent_trials=2),
        # Ray CPUs are scheduling slots: the 2 training workers hold one each for the whole run,
        # and the Ray Data tasks streaming their shards need slots of their own.
        ray=RayConfig(num_cpus=4),
    )


MODEL_CPU_SMALL = DebertaConfig(vocab_size=8_100, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=1024, max_position_embeddings=128, position_buckets=32,
                                share_att_key=True, norm_rel_ebd=True)
"""4 x 256, 4 heads, V3's relative-position layout scaled to 128 positions: sized to pretrain on the built-in news
corpus in about an hour on 2 CPUs; whether that pretraining helps fine-tuning is what bench/continued.py measures."""


def cpu_small() -> PipelineConfig:
    """A model worth pretraining on 2 CPUs: 4 x 256 on the built-in news corpus, 8,000 pieces, 128-token sequences."""
    cfg = debug()
    pieces = 8_000
    return dataclasses.replace(
        cfg, preset="cpu-small", model=_with_vocab(MODEL_CPU_SMALL, pieces),
        vocab=dataclasses.replace(cfg.vocab, vocab_size=pieces),
        pretrain=dataclasses.replace(cfg.pretrain, micro_batch_size=16, train_batch_size=32, lr=1e-3,
                                     warmup_steps=100, max_steps=2_000, eval_interval=500, ckpt_interval=500),
        finetune=dataclasses.replace(cfg.finetune, lr=(1e-4, 3e-4), dropout=(0.1,)))


def long_sequences(cfg: PipelineConfig, length: int) -> PipelineConfig:
    """`cfg` at `length`-token sequences (past 512) with DeBERTaV3's relative layout: 256 log buckets over
    max_relative_positions=512 (its released configs), so distances past 128 share rows logarithmically and past
    512 the last one; the EMD's absolute table grows to `length`. The micro-batch shrinks so a step holds the same
    number of tokens as at `cfg`'s length (at least one sequence)."""
    model = cfg.model.replace(max_position_embeddings=length, position_buckets=256, max_relative_positions=512)
    scale = max(1, length // cfg.tokenize.max_seq_len)
    micro = max(1, cfg.pretrain.micro_batch_size // scale)
    workers = cfg.pretrain.num_workers
    return dataclasses.replace(
        cfg, preset=f"{cfg.preset}-{length}", model=model,
        tokenize=dataclasses.replace(cfg.tokenize, max_seq_len=length),
        pretrain=dataclasses.replace(cfg.pretrain, micro_batch_size=micro,
                                     train_batch_size=max(micro * workers, cfg.pretrain.train_batch_size // scale)))


def cpu_small_1024() -> PipelineConfig:
    """cpu-small at 1,024-token sequences (`long_sequences`)."""
    return long_sequences(cpu_small(), 1024)


def cpu_small_2048() -> PipelineConfig:
    """cpu-small at 2,048-token sequences (`long_sequences`)."""
    return long_sequences(cpu_small(), 2048)


def _paper(name: str, model: DebertaConfig, lr: float, workers: int, micro: int, zero: int, grid: dict, sift: bool,
           ft_workers: int = 1) -> PipelineConfig:
    """Table 8 schedule: 2,048 x 512-token sequences per step, 10k warmup, 1M steps, AdamW."""
    return PipelineConfig(
        preset=name,
        model=_with_vocab(model, PIECES_128K),
        corpus=WEB_CORPUS,
        vocab=VocabConfig(vocab_size=PIECES_128K, sample_documents=10_000_000),
        tokenize=TokenizeConfig(max_seq_len=512),
        pretrain=PretrainConfig(num_workers=workers, use_gpu=True, cpus_per_worker=8, zero_stage=zero,
                                micro_batch_size=micro, train_batch_size=2_048, lr=lr, warmup_steps=10_000,
                                max_steps=1_000_000, eval_interval=5_000, ckpt_interval=5_000, log_interval=10,
                                probe_interval=50_000, probe_lr=(2e-5, 5e-5), probe_gpus=1.0),
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


def debug_v3() -> PipelineConfig:
    """The debug run with DeBERTaV3's objective: a 1-layer generator, RTD with GDES on the 3-layer discriminator."""
    cfg = debug()
    return dataclasses.replace(cfg, preset="debug-v3", pretrain=dataclasses.replace(cfg.pretrain, objective="rtd"))


def _v3(name: str, model: DebertaConfig, lr: float, workers: int, micro: int, grid: dict) -> PipelineConfig:
    """Table 10: 8,192 x 512-token sequences per step, 500k steps, 10k warmup, Adam eps 1e-6 and betas (0.9, 0.98),
    weight decay 0.01, clipping 1.0, dropout 0.1; RTD with lambda 50 and GDES; the 128K vocabulary."""
    return PipelineConfig(
        preset=name,
        model=_with_vocab(model, PIECES_128K),
        corpus=WEB_CORPUS,
        vocab=VocabConfig(vocab_size=PIECES_128K, sample_documents=10_000_000),
        tokenize=TokenizeConfig(max_seq_len=512),
        pretrain=PretrainConfig(num_workers=workers, use_gpu=True, cpus_per_worker=8, zero_stage=2,
                                micro_batch_size=micro, train_batch_size=8_192, lr=lr, warmup_steps=10_000,
                                max_steps=500_000, adam_beta2=0.98, objective="rtd", rtd_weight=50.0,
                                embedding_sharing="gdes", eval_interval=5_000, ckpt_interval=5_000, log_interval=10,
                                probe_interval=50_000, probe_lr=(2e-5, 5e-5), probe_gpus=1.0),
        finetune=FinetuneConfig(**grid, epochs=10, max_seq_len=256, use_gpu=True, seeds=PAPER_SEEDS,
                                max_concurrent_trials=8),
    )


def deberta_v3_xsmall() -> PipelineConfig:
    return _v3("deberta-v3-xsmall", MODEL_V3_XSMALL, lr=6e-4, workers=32, micro=64, grid=GRID_BASE)


def deberta_v3_small() -> PipelineConfig:
    return _v3("deberta-v3-small", MODEL_V3_SMALL, lr=6e-4, workers=32, micro=64, grid=GRID_BASE)


def deberta_v3_base() -> PipelineConfig:
    return _v3("deberta-v3-base", MODEL_V3_BASE, lr=6e-4, workers=64, micro=32, grid=GRID_BASE)


def deberta_v3_large() -> PipelineConfig:
    return _v3("deberta-v3-large", MODEL_V3_LARGE, lr=3e-4, workers=128, micro=16, grid=GRID_V3_LARGE)


def _v3_continue(base: PipelineConfig, workers: int, micro: int) -> PipelineConfig:
    """The authors' continue recipe (microsoft/DeBERTa experiments/language_model/rtd.sh, deberta-v3-*-continue):
    generator and discriminator from the released checkpoints (`pretrain.init`, required: the [model] section and
    the vocabulary are the checkpoint's), lr 5e-5, warmup 10,000, 100,000 steps, batch 256 x 512 tokens, otherwise
    Table 10's settings."""
    return dataclasses.replace(
        base, preset=f"{base.preset}-continue",
        pretrain=dataclasses.replace(base.pretrain, num_workers=workers, micro_batch_size=micro, train_batch_size=256,
                                     lr=5e-5, warmup_steps=10_000, max_steps=100_000, eval_interval=2_000,
                                     ckpt_interval=2_000))


def deberta_v3_xsmall_continue() -> PipelineConfig:
    return _v3_continue(deberta_v3_xsmall(), workers=8, micro=32)


def deberta_v3_small_continue() -> PipelineConfig:
    return _v3_continue(deberta_v3_small(), workers=8, micro=32)


def deberta_v3_base_continue() -> PipelineConfig:
    return _v3_continue(deberta_v3_base(), workers=8, micro=32)


def deberta_v3_large_continue() -> PipelineConfig:
    return _v3_continue(deberta_v3_large(), workers=16, micro=16)


PRESETS = {
    "debug": debug,
    "debug-v3": debug_v3,
    "cpu-small": cpu_small,
    "cpu-small-1024": cpu_small_1024,
    "cpu-small-2048": cpu_small_2048,
    "deberta-base": deberta_base,
    "deberta-large": deberta_large,
    "deberta-1.5b": deberta_1_5b,
    "deberta-v3-xsmall": deberta_v3_xsmall,
    "deberta-v3-small": deberta_v3_small,
    "deberta-v3-base": deberta_v3_base,
    "deberta-v3-large": deberta_v3_large,
    "deberta-v3-xsmall-continue": deberta_v3_xsmall_continue,
    "deberta-v3-small-continue": deberta_v3_small_continue,
    "deberta-v3-base-continue": deberta_v3_base_continue,
    "deberta-v3-large-continue": deberta_v3_large_continue,
}
CONTINUE_PRESETS = frozenset(name for name in PRESETS if name.endswith("-continue"))
"""Presets that continue a released checkpoint: `pretrain.init` must be set (the run refuses otherwise)."""


def missing_for_preset(name: str, cfg: PipelineConfig) -> str | None:
    """What the preset needs that the command line did not give, as the fix to print; None when nothing is."""
    if name in CONTINUE_PRESETS and not cfg.pretrain.init:
        return (f"preset {name} continues pretraining a released checkpoint; add --set pretrain.init=DIR (an HF "
                f"DeBERTa-v3 directory) or models:/NAME/VERSION")
    return None
