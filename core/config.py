"""Typed, frozen configuration of the whole pipeline: plain data, no model code (and no torch).

One dataclass per section; `PipelineConfig` composes them. The [model] section is the model library's own
`deberta.config.DebertaConfig` (torch-free): one class for the architecture, checked as it is built. Presets
(pipeline/presets.py) build a `PipelineConfig`; the command line changes it only through `apply_overrides`
("section.key=value").

Validation happens once, before any stage runs: every section checks its own fields (`Section.check`),
`validate` adds the invariants that span sections, and `check_cluster` the ones that need the live Ray
cluster (CPUs, GPUs). Builders downstream (DeepSpeed JSON, engines) assume a valid config; a stage checks
only what needs its input artifacts (tokenizer length, sequence length of the token shards).

What and how: each section's `HOW` names the fields that change how a stage runs (resources, logging,
fault tolerance, progress) but not what it produces. They stay out of artifact ids (`Section.what`), so
changing them never throws a finished artifact away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.corpus_filters import language_codes, resolve as resolve_filters
from core.corpus_sources import CorpusSource, check_sources
from core.errors import ConfigError
from deberta.config import DebertaConfig, DebertaConfigError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _plain(values: tuple) -> str:
    """A grid as the user types it on the command line (`1e-05,2e-05`), not as a Python tuple."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value >= 1, f"{section}.{name}={value}: must be >= 1")


@dataclass(frozen=True)
class Section:
    """A config section: its own checks, and which of its fields name *how* a stage runs, not *what* it makes.

    `DebertaConfig`, the [model] section, follows the same protocol (`HOW`, `check`, `what`, `to_dict`) without
    deriving from this class: the model library imports nothing above it.
    """

    HOW: ClassVar[frozenset[str]] = frozenset()

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix; sections without rules accept anything typed right."""

    def what(self) -> dict[str, Any]:
        """The fields hashed into artifact ids: every field but the `HOW` ones."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.HOW}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ZERO_STAGES = (0, 1, 2, 3)
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
PRECISIONS = ("auto", "fp32", "bf16")


PROBE_FIELDS = ("probes", "probe_interval", "probe_examples", "probe_max_steps", "probe_patience", "probe_lr",
                "probe_batch_size", "probe_warmup_steps", "probe_seeds", "probe_max_seq_len", "probe_cpus",
                "probe_gpus")

ACTIVATION_CHECKPOINTING = "none, all, or every-K (K >= 1: layers 0, K, 2K, ...; every-1 is all)"
OFFLOADS = ("none", "optimizer", "optimizer+parameters")


def checkpoint_every(value: str, key: str = "pretrain.activation_checkpointing") -> int:
    """`activation_checkpointing` -> K: the encoder recomputes layers 0, K, 2K, ... in the backward pass (1: every
    layer; 0: none). ConfigError naming `key` for anything else."""
    text = value.strip().lower()
    if text == "none":
        return 0
    if text == "all":
        return 1
    k = text.removeprefix("every-")
    _check(text.startswith("every-") and k.isdigit() and int(k) >= 1,
           f"{key}={value!r}: use {ACTIVATION_CHECKPOINTING}, e.g. {key}=every-2")
    return int(k)


def check_offload(offload: str, zero_stage: int, section: str) -> None:
    """DeepSpeed's ZeRO-Offload: optimizer states from ZeRO-1 on, parameters only where ZeRO-3 partitions them."""
    _check(offload in OFFLOADS, f"{section}.offload={offload!r}: use one of {', '.join(OFFLOADS)}")
    _check(offload == "none" or zero_stage >= 1,
           f"{section}.offload={offload}: DeepSpeed offloads the optimizer states ZeRO shards, and ZeRO-0 shards "
           f"none; set {section}.zero_stage=1, 2 or 3 (or offload=none)")
    _check(offload != "optimizer+parameters" or zero_stage == 3,
           f"{section}.offload=optimizer+parameters: DeepSpeed offloads parameters only under ZeRO-3, which "
           f"partitions them (zero_stage={zero_stage}); set {section}.zero_stage=3, or offload=optimizer")


def check_zero_stage(stage: int, section: str) -> None:
    _check(stage in ZERO_STAGES, f"{section}.zero_stage={stage}: DeepSpeed ZeRO stages are 0, 1, 2 and 3 "
                                 f"(2 shards optimizer state + gradients, 3 also parameters)")


@dataclass(frozen=True)
class RayConfig(Section):
    """How Ray is started or joined: never part of an artifact id."""

    num_cpus: int | None = None
    """CPUs for a local Ray started by the pipeline (None: all of this machine's). Ignored when joining a cluster."""
    object_store_gb: float = 2.0
    """Object-store size of a local Ray, in GiB. Ray's default (30% of RAM) is too much beside training workers."""
    dashboard: bool = True
    """Start the Ray dashboard (127.0.0.1:8265) with a local Ray; Ray Train and the State API rely on it."""
    storage_path: str | None = None
    """Ray Train/Tune storage every node can reach (path or pyarrow.fs URI); None: <workdir>/ray_results."""

    HOW: ClassVar[frozenset[str]] = frozenset({"num_cpus", "object_store_gb", "dashboard", "storage_path"})

    def check(self) -> None:
        _check(self.num_cpus is None or self.num_cpus >= 1, f"ray.num_cpus={self.num_cpus}: must be >= 1 (or none)")
        _check(self.object_store_gb > 0, f"ray.object_store_gb={self.object_store_gb}: must be > 0")


@dataclass(frozen=True)
class CorpusConfig(Section):
    sources: tuple[str, ...] = ()
    """Named sources, each `NAME=PATH_OR_URI[:weight=W|:epochs=E]` (`CorpusSource`); `--corpus` fills it when its
    arguments are named. Empty: one unnamed source, `--corpus PATH...` or the built-in corpus. *How*: what the
    sources are (names, weights, epochs, each file) is the raw input's own id, as a corpus path is."""
    txt_mode: str = "document"
    """How `.txt` files become documents: "document" (one per file) or "line" (one per non-empty line)."""
    jsonl_field: str = "text"
    """Field of a `.jsonl` record that holds the text."""
    parquet_column: str = "text"
    """Column of a `.parquet` file that holds the text."""
    shingle: str = "char"
    """Shingle type for MinHash: "char" (character n-grams, as Megatron-LM) or "word"."""
    shingle_size: int = 5
    """n of the n-gram shingles (character 5-grams by default)."""
    num_perm: int = 128
    """MinHash permutations per signature."""
    threshold: float = 0.7
    """Jaccard similarity at and above which two documents are near-duplicates (bands x rows derive from it)."""
    validation_fraction: float = 0.05
    """Share of deduplicated documents held out for validation (paper A.2: 5%), chosen by a hash of doc_id."""
    rows_per_shard: int = 20_000
    """Target documents per output Parquet shard."""
    max_doc_bytes: int = 8 * 1024 * 1024
    """Documents larger than this are rejected (reason recorded) rather than hashed."""
    seed: int = 0
    """Seed of the MinHash permutations."""
    batch_size: int = 512
    """Documents per Ray Data batch in the corpus stage (bounds each worker's memory)."""
    filters: tuple[str, ...] = ()
    """Quality rules removing documents before dedup (`core.corpus_filters`: Gopher, Rae et al. 2021; C4, Raffel et
    al. 2020; FineWeb, Penedo et al. 2024), read left to right: a group (`gopher_repetition`, `gopher_quality`, `c4`,
    `fineweb`, `all`) at datatrove's published thresholds, `RULE=VALUE` to set one, `RULE=off` or `GROUP=off`;
    e.g. `all,c4=off,gopher_min_words=20`. Empty: none. The paper-size presets ingest users' web text and turn on
    `all`; the CPU presets' built-in news corpus (a title line, then the article as one line) would lose 65% of its
    3,824 articles to them (C4's sentence count and FineWeb's line punctuation see two lines without a full stop),
    so they keep none."""
    languages: tuple[str, ...] = ()
    """Keep only documents whose most likely language (py3langid, ISO 639-1 codes, e.g. `en`) is one of these with
    probability >= `language_threshold`; empty: no language identification."""
    language_threshold: float = 0.65
    """The probability the top language needs (datatrove's LanguageFilter default)."""
    decontaminate: tuple[str, ...] = ()
    """Fine-tuning tasks (built-in names or task directories, as `--task`) whose dev examples the corpus must not
    hold: a document sharing a `decontaminate_ngram`-word n-gram with one (lower-cased, punctuation removed; GPT-3,
    Brown et al. 2020, App. C) is removed whole, its rule `decontaminate:<task>` in filtered.parquet. *How*: the
    tasks' content is hashed into the corpus artifact's id through the stage's `decontaminate` input, not their
    names."""
    decontaminate_ngram: int = 13
    """Words per n-gram of `decontaminate` (an example shorter than this counts whole from 8 words; *how*: it is part
    of the `decontaminate` input's id)."""

    HOW: ClassVar[frozenset[str]] = frozenset({"sources", "decontaminate", "decontaminate_ngram"})

    def what(self) -> dict[str, Any]:
        """The rules by what they resolve to, so `all` and the list of its rules name one artifact."""
        return {**super().what(), "filters": resolve_filters(self.filters)}

    def blend(self) -> tuple[CorpusSource, ...]:
        """`sources` parsed, in the order listed (ConfigError on a malformed one)."""
        return tuple(CorpusSource.parse(s) for s in self.sources)

    def check(self) -> None:
        check_sources(self.blend())
        _check(self.txt_mode in ("document", "line"), f"corpus.txt_mode={self.txt_mode!r}: use document or line")
        _check(self.shingle in ("char", "word"), f"corpus.shingle={self.shingle!r}: use char or word")
        _check(0.0 < self.threshold <= 1.0, f"corpus.threshold={self.threshold}: must be in (0, 1]")
        _check(0.0 < self.validation_fraction < 1.0,
               f"corpus.validation_fraction={self.validation_fraction}: must be in (0, 1)")
        _check(self.num_perm >= 16, f"corpus.num_perm={self.num_perm}: use at least 16 permutations")
        _positive("corpus", self, "shingle_size", "rows_per_shard", "max_doc_bytes", "batch_size")
        resolve_filters(self.filters)
        _check(self.decontaminate_ngram >= 8, f"corpus.decontaminate_ngram={self.decontaminate_ngram}: use at least 8 "
                                              f"words (GPT-3 and NeMo Curator use 13)")
        _check(0.0 <= self.language_threshold < 1.0,
               f"corpus.language_threshold={self.language_threshold}: must be in [0, 1)")
        unknown = [code for code in self.languages if code not in language_codes()] if self.languages else []
        _check(not unknown, f"corpus.languages={','.join(self.languages)}: {', '.join(unknown)} is not a language "
                            f"py3langid knows; use its ISO 639 codes, e.g. en, de, fr, es, zh")


@dataclass(frozen=True)
class VocabConfig(Section):
    vocab_size: int = 8_000
    """SentencePiece pieces, [PAD] [CLS] [SEP] [UNK] included; [MASK] is appended after them (1.5B: 128,000)."""
    model_type: str = "unigram"
    """SentencePiece algorithm: "unigram" (default) or "bpe"."""
    sample_documents: int = 200_000
    """Documents sampled (deterministically, by doc_id hash) from the train split to train the vocabulary."""
    max_sentence_length: int = 16_384
    """Longest input line SentencePiece accepts (bytes); longer documents are split at line breaks."""
    character_coverage: float = 0.9995
    """Share of characters covered by pieces; the rest fall back to bytes."""
    seed: int = 0
    """Seed of the sample."""
    num_threads: int = 0
    """SentencePiece trainer threads; 0: every CPU available. Its EM sums per-thread partial counts, so bit-identical
    models across machines need the same fixed number here."""

    def check(self) -> None:
        _check(self.model_type in ("unigram", "bpe"), f"vocab.model_type={self.model_type!r}: use unigram or bpe")
        _check(self.vocab_size >= 64, f"vocab.vocab_size={self.vocab_size}: use at least 64 pieces")
        _check(0.0 < self.character_coverage <= 1.0,
               f"vocab.character_coverage={self.character_coverage}: must be in (0, 1]")
        _check(self.num_threads >= 0, f"vocab.num_threads={self.num_threads}: must be >= 0 (0: all CPUs)")
        _positive("vocab", self, "sample_documents", "max_sentence_length")


@dataclass(frozen=True)
class TokenizeConfig(Section):
    max_seq_len: int = 512
    """Tokens per packed sequence, [CLS] and [SEP] included."""
    batch_size: int = 256
    """Documents tokenized and packed together (packing never crosses a batch; bounds each actor's memory)."""
    rows_per_shard: int = 50_000
    """Most sequences per output shard (each corpus row group starts its own shards)."""
    num_workers: int | None = None
    """Tokenizer actors (each loads the SentencePiece model once, one CPU each); None: one per CPU of the cluster."""
    segment_pairs: bool = False
    """ALBERT's sentence-order data: each row is `[CLS] A [SEP] B [SEP]`, two consecutive spans of one document,
    swapped with probability 0.5 (seeded by `seed`), with a `sop_label` column (1: swapped)."""
    seed: int = 0
    """Seed of the segment-pair swaps (the train order is drawn by pretraining, from `pretrain.seed`)."""

    HOW: ClassVar[frozenset[str]] = frozenset({"num_workers"})

    def check(self) -> None:
        _check(self.max_seq_len >= 3, f"tokenize.max_seq_len={self.max_seq_len}: needs room for [CLS], a token "
                                      f"and [SEP] (>= 3)")
        _check(self.num_workers is None or self.num_workers >= 1,
               f"tokenize.num_workers={self.num_workers}: use at least 1 (or none for one per CPU)")
        _positive("tokenize", self, "batch_size", "rows_per_shard")


@dataclass(frozen=True)
class PretrainConfig(Section):
    num_workers: int = 2
    """Ray Train workers (one per GPU on GPU clusters)."""
    use_gpu: bool = False
    """Train on GPUs (bf16) instead of CPUs (fp32, gloo)."""
    cpus_per_worker: int = 1
    """CPUs reserved for each training worker."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage: 0, 1, 2 or 3."""
    micro_batch_size: int = 8
    """Sequences per worker per forward pass."""
    train_batch_size: int = 16
    """Sequences per optimizer step over all workers; must equal micro x accumulation x workers."""
    lr: float = 2e-4
    """Peak AdamW learning rate (Table 8)."""
    warmup_steps: int = 10_000
    """Linear warmup steps, then linear decay to zero at max_steps (Table 8)."""
    max_steps: int = 1_000_000
    """Optimizer steps."""
    weight_decay: float = 0.01
    adam_eps: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    objective: str = "mlm"
    """The pretraining objective by name, one of `stages.pretrain.objectives.OBJECTIVES`: mlm (DeBERTa's masked LM
    with the EMD) or rtd (DeBERTaV3's replaced-token detection: a generator of `generator_layers` trained with MLM,
    the discriminator on RTD; DeBERTaV3 §2.3). Each objective checks the fields it reads (`check_config` there),
    beside `validate`; the fields below marked objective=rtd are that objective's."""
    rtd_weight: float = 50.0
    """lambda of L = L_MLM + lambda * L_RTD (objective=rtd; DeBERTaV3 §2.3: 50, the reference code's default: 10)."""
    embedding_sharing: str = "gdes"
    """Word embeddings of generator and discriminator (objective=rtd, DeBERTaV3 §3.2-3.3): "gdes"
    (gradient-disentangled: E_D = sg(E_G) + E_delta), "es" (one table both losses update) or "nes" (two tables)."""
    generator_layers: int | None = None
    """Generator depth (objective=rtd); None: half the discriminator's (Table 10)."""
    sop: bool = False
    """ALBERT's sentence-order prediction as a second loss: reads the `sop_label` of token shards written with
    tokenize.segment_pairs=true ([CLS] A [SEP] B [SEP], B before A half of the time)."""
    mlm_probability: float = 0.15
    """Share of non-special tokens that become MLM targets."""
    max_ngram: int = 3
    """Longest whole-word span masked at once (p(n) proportional to 1/n)."""
    log_interval: int = 1
    """Steps between progress lines and MLflow metric points."""
    eval_interval: int = 1_000
    """Steps between validation passes (MLM loss, accuracy, perplexity)."""
    eval_batches: int = 50
    """Micro-batches per validation pass on each worker."""
    ckpt_interval: int = 1_000
    """Steps between DeepSpeed checkpoints reported to Ray Train."""
    max_failures: int = 3
    """Worker failures Ray Train recovers from (restoring the latest checkpoint)."""
    placement_strategy: str = "PACK"
    """Ray placement of the training workers: "PACK" (fill a node's GPUs first) or "SPREAD" (one per node first)."""
    seed: int = 0
    """Seeds model init, span masks (with step, micro-batch and rank) and the data order (a permutation of all
    sequences per epoch, seeded by (seed, epoch): `stages.pretrain.data`)."""
    init: str = ""
    """Continue pretraining a released checkpoint instead of starting from random weights: an HF DeBERTa-v2/v3
    directory (config.json, weights, spm.model) or a registry version (models:/NAME/VERSION, models:/NAME@ALIAS).
    Its config.json is the [model] section and its tokenizer the vocab stage's (`stages.pretrain.continued` decides
    what it implies; docs/pretraining.md)."""
    generator_init: str = ""
    """objective=rtd with `init`: the generator to start from (an HF DebertaV2ForMaskedLM directory or registry
    version); "" = the authors' pytorch_model.generator.bin beside `init` if there is one, else the lower
    `generator_layers` layers of the discriminator."""
    precision: str = "auto"
    """Arithmetic of the forward pass: "fp32", "bf16" (GPU: DeepSpeed's bf16; CPU: `torch.autocast` to bfloat16
    with fp32 master weights, gradients and gloo all-reduce) or "auto" (`training.precision.resolve`: bf16 on GPU,
    and on CPUs with native bf16 where bench/results/step_speed.json measured it faster)."""
    compile: bool = False
    """`torch.compile` the encoder layers, on plain torch and under DeepSpeed alike (`deberta.model.compile_layers`):
    each compiles once per mode (train, eval) in the first steps; the parts whose shapes follow the data (the MLM
    targets, the EMD, the heads) stay eager. Off by default: every process pays a cold compilation first, and under
    ZeRO-3 DeepSpeed's parameter hooks break each layer's graph (bench/results/compile_stage.json measures the
    stage; docs/pretraining.md says where it pays)."""
    emd: bool = True
    """The enhanced mask decoder in the MLM (DeBERTa §3.2; the MLM objective and RTD's generator). false: the
    MLM head reads the backbone's last layer, as HF's DebertaV2ForMaskedLM does (continuing a checkpoint then
    starts from exactly the function it was released as)."""
    document_mask: bool = False
    """Attention stays inside each document of a packed row (block-diagonal, from the token shards' `doc_index`
    column; relative positions inside a document unchanged). Off by default: today's results stay as they were.
    Read by the objectives that say so (`reads_documents`: mlm; the RTD pair and SOP's one-document rows do not)."""
    activation_checkpointing: str = "none"
    """Recompute encoder layers in the backward pass instead of keeping their activations: "none", "all" (every
    layer keeps only its input), or "every-K" (layers 0, K, 2K, ...). Same losses (torch's non-reentrant checkpoint
    restores the RNG, so dropout repeats), less memory, more time: docs/pretraining.md has the memory plan."""
    offload: str = "none"
    """DeepSpeed ZeRO-Offload: "none", "optimizer" (fp32 master weights and Adam's moments in CPU memory, the step
    on the CPU; ZeRO 1-3) or "optimizer+parameters" (parameters too; ZeRO-3 only)."""
    gpu_memory_gb: float | None = None
    """Memory of one training GPU in GB (1e9 bytes) for the memory plan (`--dry-run`, and the check before a GPU run);
    None: the driver's GPU when it has one, else the plan names no limit."""

    probes: tuple[str, ...] = ()
    """Fine-tuning tasks to probe the run with (built-in names or task directories, any kind; `stages.pretrain.probes`):
    at step 0 (the from-scratch control) and every `probe_interval` steps the newest checkpoint is fine-tuned on
    each by the finetune stage's trial code, beside training, and `probe.<task>.<metric>` logged against the step.
    Empty (the default): no probes, nothing added to the run."""
    probe_interval: int = 1_000
    """Steps between probes; a multiple of `ckpt_interval` (a probe reads a checkpoint). The last step is probed too."""
    probe_examples: int | None = 200
    """Label budget: training rows each probe fine-tunes on (a fixed-seed sample; None: all)."""
    probe_max_steps: int = 2_000
    """Budget of each probe trial in optimizer steps, rounded up to whole epochs of the label budget (one dev
    evaluation per epoch, as in the finetune stage); the learning rate decays linearly to zero at the budget. A probe
    trains to convergence, not for a fixed few epochs: it stops earlier when its dev metric stops improving
    (`probe_patience`), and the best epoch's dev metric counts."""
    probe_patience: int = 5
    """Early stopping: a probe trial ends after this many evaluations (epochs) in a row without a new best dev
    metric; one still improving when its budget is spent is reported as not converged (raise `probe_max_steps`)."""
    probe_lr: tuple[float, ...] = (5e-5, 1e-4)
    """The probes' fixed grid of learning rates: the grid point with the best seed mean is logged (the finetune
    stage's selection at a fixed label budget; collapsed seeds are left out and counted, `stages.pretrain.probes`)."""
    probe_batch_size: int = 16
    probe_warmup_steps: int = 10
    probe_seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds of each grid point: the mean is logged as `probe.<task>.<metric>`, the spread as `..._std`."""
    probe_max_seq_len: int = 128
    """Tokens per probe example ([CLS]/[SEP] included)."""
    probe_cpus: int = 1
    """CPUs per probe trial (one Ray task each)."""
    probe_gpus: float = 0.0
    """GPUs per probe trial: 0 (CPUs), 1 (a GPU of its own: they wait for a free one), or a fraction (sharing a
    training GPU's memory; docs/pretraining.md)."""

    HOW: ClassVar[frozenset[str]] = frozenset({"log_interval", "eval_interval", "eval_batches", "ckpt_interval",
                                               "max_failures", "cpus_per_worker", "placement_strategy", "init",
                                               "generator_init", "compile", "activation_checkpointing", "offload",
                                               "gpu_memory_gb", *PROBE_FIELDS})
    """`init` and `generator_init` name where the weights come from; their digests are the stage's inputs. The probes
    measure the run without changing its weights; checkpointing and offload change where and when numbers are kept,
    not the numbers."""

    def check(self) -> None:
        check_zero_stage(self.zero_stage, "pretrain")
        _positive("pretrain", self, "num_workers", "micro_batch_size", "max_steps", "log_interval", "eval_interval",
                  "eval_batches", "ckpt_interval", "cpus_per_worker", "max_ngram")
        pretrain_accumulation(self, self.num_workers)
        _check(self.warmup_steps >= 0, f"pretrain.warmup_steps={self.warmup_steps}: must be >= 0")
        _check(self.lr > 0, f"pretrain.lr={self.lr}: must be > 0")
        _check(0.0 < self.mlm_probability < 1.0, f"pretrain.mlm_probability={self.mlm_probability}: must be in (0, 1)")
        _check(self.max_failures >= 0, f"pretrain.max_failures={self.max_failures}: must be >= 0")
        _check(self.placement_strategy in PLACEMENTS,
               f"pretrain.placement_strategy={self.placement_strategy!r}: use one of {', '.join(PLACEMENTS)}")
        _check(self.precision in PRECISIONS, f"pretrain.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
        check_probes(self)
        checkpoint_every(self.activation_checkpointing)
        check_offload(self.offload, self.zero_stage, "pretrain")
        _check(self.gpu_memory_gb is None or self.gpu_memory_gb > 0,
               f"pretrain.gpu_memory_gb={self.gpu_memory_gb}: must be > 0 (or none)")


@dataclass(frozen=True)
class FinetuneConfig(Section):
    task: str = "rotten-tomatoes"
    """Built-in task name or a task directory: GLUE-format train/dev files, CoNLL/JSONL token files or SQuAD JSON
    (docs/serving.md); or several, comma-separated, and `all` (every built-in task): each is its own sweep,
    artifact and registry model, and the run prints and logs their table (DeBERTa Table 2's row; pipeline/suite.py)."""
    init: str = ""
    """The checkpoint to fine-tune: "" = this pipeline's pretrain artifact; an HF DeBERTa-v2 directory; or a
    registry version, models:/NAME/VERSION or models:/NAME@ALIAS (downloaded into the workdir). Not empty, the
    finetune stage runs alone with the checkpoint's architecture as the [model] section (`--pretrained X` is
    short for it)."""
    dropout: tuple[float, ...] = (0.0, 0.1, 0.15)
    """Grid: task-layer dropout (Table 9)."""
    warmup_steps: tuple[int, ...] = (50, 100, 500, 1000)
    """Grid: warmup steps (Table 9)."""
    lr: tuple[float, ...] = (1.5e-5, 2e-5, 3e-5, 4e-5)
    """Grid: learning rates (Table 9)."""
    batch_size: tuple[int, ...] = (16, 32, 48, 64)
    """Grid: batch sizes (Table 9)."""
    epochs: int = 10
    """Maximum training epochs (Table 9)."""
    max_seq_len: int = 128
    """Tokens per example (per window of a long token or span example), [CLS]/[SEP] included."""
    doc_stride: int = 32
    """Token and span tasks: pieces shared by consecutive windows of a text longer than `max_seq_len` (the
    `stride` of transformers' tokenizers and run_qa.py); less than a window's text (span: its context, at least
    max_seq_len / 2 - 1 pieces)."""
    max_answer_len: int = 30
    """Span tasks: the longest answer the span search considers, in pieces (BERT's run_squad.py default)."""
    max_train_examples: int | None = None
    """Cap on training rows (None: all; a token or span example split into windows counts each window); the
    debug preset uses it to stay within minutes."""
    weight_decay: float = 0.01
    adam_eps: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    sift: bool = False
    """Scale-invariant fine-tuning (paper section 4; on for 1.5B)."""
    sift_lambda: float = 5.0
    """Weight of the SiFT adversarial term."""
    seeds: tuple[int, ...] = (0,)
    """Seeds per grid point (the paper reports the mean of 5)."""
    scheduler: str = "grid"
    """"grid": every combination to the end; "asha": asynchronous successive halving on the dev metric."""
    max_concurrent_trials: int = 2
    """Trials of one task's sweep run at once (Tune's bound per sweep; the tasks of a suite run side by side, each
    with this bound, and Ray holds them all to the cluster's CPUs and GPUs)."""
    tasks_at_once: int = 0
    """Tasks of a suite (`task=A,B,C`) fine-tuned side by side: 0 = as many as fill the cluster's room for trials
    and one more (`stages.finetune.sweep.sweeps_at_once`); 1 = one after another; N = at most N."""
    trainer: str = "torch"
    """"torch": each trial is one plain-torch process (one GPU at most); "deepspeed": each trial is a Ray Train
    run of `workers_per_trial` DeepSpeed workers (data parallel, ZeRO `zero_stage`), for models one device
    cannot fine-tune fast enough or at all."""
    workers_per_trial: int = 1
    """DeepSpeed workers per trial (trainer=deepspeed); every grid batch size must divide by it."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage of the trials (trainer=deepspeed)."""
    cpus_per_trial: int = 1
    """CPUs per trial (per worker with trainer=deepspeed)."""
    use_gpu: bool = False
    """Fine-tune on GPUs (one per trial, or per worker with trainer=deepspeed)."""
    precision: str = "auto"
    """As pretrain.precision, for the trials."""
    compile: bool = False
    """As pretrain.compile, for the trials."""
    control: str = ""
    """"scratch": also sweep the same grid and seeds from the same architecture's initial weights (the from-scratch
    control, `stages.finetune.control`) and record the champion's gain over it on its registry version; "": none."""
    activation_checkpointing: str = "none"
    """As pretrain.activation_checkpointing, for the trials' backbone."""
    max_failures: int = 2
    """Retries of a trial whose process, worker or node dies (Tune's `FailureConfig`, the one level that retries:
    a DeepSpeed trial's Ray Train run has none of its own, so a lost worker fails the trial and Tune restarts it).
    A torch trial resumes from its newest epoch checkpoint, a DeepSpeed trial from scratch; -1 retries forever."""

    HOW: ClassVar[frozenset[str]] = frozenset({"task", "init", "max_concurrent_trials", "tasks_at_once",
                                               "cpus_per_trial", "max_failures", "compile",
                                               "activation_checkpointing"})
    """`task` and `init` name where the examples and the checkpoint come from; their own ids (digests) are the
    stage's inputs, so one checkpoint reached by two paths is one artifact."""

    def check(self) -> None:
        _check(all(t.strip() for t in self.task.split(",")),
               f"finetune.task={self.task!r}: an empty task name; list tasks as A,B,C")
        _check(self.scheduler in ("grid", "asha"), f"finetune.scheduler={self.scheduler!r}: use grid or asha")
        for name in ("dropout", "warmup_steps", "lr", "batch_size", "seeds"):
            _check(len(getattr(self, name)) > 0, f"finetune.{name} is empty: give at least one value")
        _check(all(0.0 <= d < 1.0 for d in self.dropout),
               f"finetune.dropout={_plain(self.dropout)}: each must be in [0, 1)")
        _check(all(lr > 0 for lr in self.lr), f"finetune.lr={_plain(self.lr)}: each learning rate must be > 0")
        _check(all(b >= 1 for b in self.batch_size),
               f"finetune.batch_size={_plain(self.batch_size)}: each batch size must be >= 1")
        _check(all(w >= 0 for w in self.warmup_steps),
               f"finetune.warmup_steps={_plain(self.warmup_steps)}: each must be >= 0")
        _positive("finetune", self, "epochs", "max_concurrent_trials")
        _check(self.tasks_at_once >= 0, f"finetune.tasks_at_once={self.tasks_at_once}: must be >= 0 (0: as many as "
                                        f"the cluster holds)")
        _check(self.max_seq_len >= 3, f"finetune.max_seq_len={self.max_seq_len}: needs room for [CLS], a token "
                                      f"and [SEP] (>= 3)")
        _check(self.doc_stride >= 0, f"finetune.doc_stride={self.doc_stride}: pieces of overlap, >= 0")
        _positive("finetune", self, "max_answer_len")
        _check(self.max_train_examples is None or self.max_train_examples >= 1,
               f"finetune.max_train_examples={self.max_train_examples}: must be >= 1 (or none for all)")
        _check(self.max_failures >= -1, f"finetune.max_failures={self.max_failures}: must be >= 0 (or -1: no limit)")
        _check(self.precision in PRECISIONS, f"finetune.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
        _check(self.control in ("", "scratch"), f"finetune.control={self.control!r}: use scratch (sweep the same grid "
                                                f"from the initial weights too) or leave it empty")
        checkpoint_every(self.activation_checkpointing, "finetune.activation_checkpointing")
        check_finetune_trainer(self)


@dataclass(frozen=True)
class PipelineConfig:
    preset: str
    """Name of the preset this configuration started from."""
    model: DebertaConfig
    """The architecture (`deberta.config.DebertaConfig`, each field documented there)."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = tuple(f.name for f in dataclasses.fields(PipelineConfig) if f.name != "preset")


def _coerce(text: str, tp: Any, key: str) -> Any:
    """Parse `text` into type `tp` (the field's annotation), or raise a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(text, inner[0], key)
    if origin is tuple:
        items = [s for s in text.strip("()[] ").split(",") if s.strip()]
        return tuple(_coerce(s.strip(), args[0], key) for s in items)
    if tp is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={text}: expected true or false")
    try:
        if tp is int:
            return int(float(text)) if "e" in text.lower() else int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"--set {key}={text}: expected {tp.__name__}, e.g. {key}=1") from None
    return text


@contextlib.contextmanager
def _library_errors(section: str) -> Iterator[None]:
    """The model library's own `DebertaConfigError` (a ValueError: deberta/ imports nothing of ours) as the
    ConfigError the command line prints, its fields named as the pipeline spells them ("model.hidden_size=65")."""
    try:
        yield
    except DebertaConfigError as e:
        raise ConfigError(e.qualified(section)) from None


def apply_overrides(cfg: PipelineConfig, overrides: list[str]) -> PipelineConfig:
    """Apply "section.key=value" overrides, checking the section, the key and the value's type.

    Each section is rebuilt once with all its changes (the last value of a key wins): the [model] section checks
    itself as it is built, so fields that only fit together (hidden_size, num_attention_heads) change together.
    """
    changes: dict[str, dict[str, Any]] = {}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. pretrain.max_steps=100")
        key, value = item.split("=", 1)
        section_name, field_name = key.split(".", 1)
        if section_name not in SECTIONS:
            raise ConfigError(f"--set {key}: unknown section {section_name!r}; sections are {', '.join(SECTIONS)}")
        section = getattr(cfg, section_name)
        hints = typing.get_type_hints(type(section))
        if field_name not in hints or typing.get_origin(hints[field_name]) is ClassVar:
            known = ", ".join(f.name for f in dataclasses.fields(section))
            raise ConfigError(f"--set {key}: unknown key {field_name!r} in [{section_name}]; keys are {known}")
        changes.setdefault(section_name, {})[field_name] = _coerce(value.strip(), hints[field_name], key)
    for section_name, fields in changes.items():
        with _library_errors(section_name):
            cfg = dataclasses.replace(cfg, **{section_name: dataclasses.replace(getattr(cfg, section_name), **fields)})
    return cfg


def with_corpus_arguments(cfg: PipelineConfig, corpus: list[str] | None) -> PipelineConfig:
    """`--corpus` arguments: all named (`NAME=PATH[:weight=W|:epochs=E]`) set `corpus.sources`; none named are
    one unnamed source, as always (`external_inputs` lists them). ConfigError for a mix, or for a corpus given both
    by `--corpus` and by `--set corpus.sources`."""
    if not corpus:
        return cfg
    named = [CorpusSource.is_named(a) for a in corpus]
    if not any(named):
        _check(not cfg.corpus.sources, "--corpus PATH and --set corpus.sources both give the corpus; give it once")
        return cfg
    unnamed = [a for a, n in zip(corpus, named) if not n]
    if unnamed:
        raise ConfigError(f"--corpus {unnamed[0]}: name every source or none (NAME=PATH_OR_URI[:weight=W|:epochs=E], "
                          f"e.g. news={unnamed[0]}), or list unnamed paths alone for one unnamed source")
    _check(not cfg.corpus.sources, "--corpus NAME=... and --set corpus.sources both give the sources; give them once")
    return dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, sources=tuple(corpus)))


def pretrain_accumulation(p: PretrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step on each worker; ConfigError unless train_batch_size splits exactly."""
    per_pass = p.micro_batch_size * world_size
    _check(p.train_batch_size % per_pass == 0 and p.train_batch_size >= per_pass,
           f"pretrain.train_batch_size={p.train_batch_size} must equal micro_batch_size x accumulation x workers "
           f"= {p.micro_batch_size} x k x {world_size} for a whole k >= 1; pick a multiple of {per_pass} "
           f"(e.g. train_batch_size={per_pass * max(1, round(p.train_batch_size / per_pass))})")
    return p.train_batch_size // per_pass


def trial_workers(f: FinetuneConfig) -> int:
    """Processes one fine-tuning trial runs on: its DeepSpeed workers, or the one torch process."""
    return f.workers_per_trial if f.trainer == "deepspeed" else 1


def check_finetune_trainer(f: FinetuneConfig) -> None:
    """The trial layout: trainer, workers, ZeRO stage, batch sizes that split over the workers."""
    _check(f.trainer in ("torch", "deepspeed"), f"finetune.trainer={f.trainer!r}: use torch or deepspeed")
    _check(f.workers_per_trial >= 1 and f.cpus_per_trial >= 1,
           f"finetune.workers_per_trial={f.workers_per_trial} and cpus_per_trial={f.cpus_per_trial} must be >= 1")
    _check(f.trainer == "deepspeed" or f.workers_per_trial == 1,
           f"finetune.workers_per_trial={f.workers_per_trial} needs finetune.trainer=deepspeed (a torch trial is one process)")
    check_zero_stage(f.zero_stage, "finetune")
    # Tune stops an ASHA loser (and a trial at ASHA's last rung) by killing its function actor; Ray 2.60 then leaves
    # the Train run's worker placement group reserved (ray-project/ray#54305): the next trials wait forever.
    _check(not (f.trainer == "deepspeed" and f.scheduler == "asha"),
           "finetune.scheduler=asha cannot stop DeepSpeed trials: Ray keeps the workers of a Train run that Tune "
           "stops reserved (ray-project/ray#54305), so the sweep would stall; use finetune.scheduler=grid, "
           "or finetune.trainer=torch")
    workers = trial_workers(f)
    uneven = [b for b in f.batch_size if b % workers]
    _check(not uneven, f"finetune.batch_size {uneven} cannot be split evenly over workers_per_trial={workers}; "
                       f"use batch sizes that are multiples of {workers} or fewer workers")


def check_probes(p: "PretrainConfig") -> None:
    """pretrain.probe_*, when probes are on; the tasks themselves are read before Ray starts
    (`pipeline.run.external_inputs`)."""
    if not p.probes:
        return
    _check(len(set(p.probes)) == len(p.probes), f"pretrain.probes={','.join(p.probes)}: a task is named twice")
    _positive("pretrain", p, "probe_interval", "probe_max_steps", "probe_patience", "probe_batch_size",
              "probe_cpus")
    _check(p.probe_interval % p.ckpt_interval == 0,
           f"pretrain.probe_interval={p.probe_interval} must be a multiple of pretrain.ckpt_interval={p.ckpt_interval} "
           f"(a probe fine-tunes a checkpoint); e.g. pretrain.probe_interval="
           f"{p.ckpt_interval * max(1, round(p.probe_interval / p.ckpt_interval))}")
    _check(p.probe_examples is None or p.probe_examples >= 1,
           f"pretrain.probe_examples={p.probe_examples}: must be >= 1 (or none for all the task's examples)")
    _check(len(p.probe_lr) > 0 and all(lr > 0 for lr in p.probe_lr),
           f"pretrain.probe_lr={_plain(p.probe_lr)}: give at least one learning rate, each > 0")
    _check(len(p.probe_seeds) > 0, "pretrain.probe_seeds is empty: give at least one seed")
    _check(p.probe_warmup_steps >= 0, f"pretrain.probe_warmup_steps={p.probe_warmup_steps}: must be >= 0")
    _check(p.probe_max_seq_len >= 3, f"pretrain.probe_max_seq_len={p.probe_max_seq_len}: needs room for [CLS], a "
                                     f"token and [SEP] (>= 3)")
    _check(p.probe_gpus == 0 or (p.use_gpu and 0 < p.probe_gpus <= 1),
           f"pretrain.probe_gpus={p.probe_gpus}: a share of one GPU in (0, 1], with pretrain.use_gpu=true (or 0: CPUs)")


def validate(cfg: PipelineConfig) -> None:
    """Every section's own checks, then the invariants across sections; run before any stage."""
    for name in SECTIONS:
        with _library_errors(name):
            getattr(cfg, name).check()
    v, t, f, m = cfg.vocab, cfg.tokenize, cfg.finetune, cfg.model
    tokenizer_len = v.vocab_size + 1  # [MASK] is appended after the SentencePiece pieces
    _check(m.vocab_size >= tokenizer_len,
           f"model.vocab_size={m.vocab_size} embedding rows < tokenizer length {tokenizer_len} "
           f"(vocab.vocab_size + [MASK]); set model.vocab_size >= {tokenizer_len} (the reference pads 128,001 to 128,100)")
    p = cfg.pretrain
    _check(not p.sop or t.segment_pairs, "pretrain.sop=true needs segment pairs in the token shards; set "
                                         "tokenize.segment_pairs=true (or pretrain.sop=false)")
    for key, length in (("tokenize.max_seq_len", t.max_seq_len), ("finetune.max_seq_len", f.max_seq_len),
                        *((("pretrain.probe_max_seq_len", p.probe_max_seq_len),) if p.probes else ())):
        _check(length <= m.max_position_embeddings,
               f"{key}={length} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
               f"lower {key} or raise model.max_position_embeddings")


def check_cluster(cfg: PipelineConfig, stages: list[str], cpus: int, gpus: int) -> None:
    """What only the live cluster can tell: enough CPUs and GPUs for the stages about to run."""
    p, f = cfg.pretrain, cfg.finetune
    if "pretrain" in stages:
        _check(not p.use_gpu or gpus >= p.num_workers,
               f"pretrain.use_gpu=true asks for {p.num_workers} GPUs but the Ray cluster has {gpus}; "
               f"add GPU nodes or set pretrain.use_gpu=false")
        held = p.num_workers * p.cpus_per_worker
        # Training workers hold their CPUs for the whole run; the Ray Data tasks that stream
        # their shards need a CPU of their own, or the run waits forever.
        _check(p.use_gpu or cpus > held,
               f"pretrain needs more than {held} Ray CPUs (num_workers x cpus_per_worker) so Ray Data can feed "
               f"the workers, but the cluster has {cpus}; set ray.num_cpus={held + 2} for a local Ray, "
               f"or lower pretrain.num_workers")
        _check(not p.probes or cpus >= p.probe_cpus,
               f"a probe trial needs pretrain.probe_cpus={p.probe_cpus} Ray CPUs but the cluster has {cpus}; lower it")
        _check(not p.probes or not p.probe_gpus or gpus >= 1,
               f"pretrain.probe_gpus={p.probe_gpus} but the Ray cluster has no GPU; set pretrain.probe_gpus=0")
    if "finetune" in stages:
        workers = trial_workers(f)
        _check(cpus >= f.cpus_per_trial * workers,
               f"one finetune trial needs {f.cpus_per_trial * workers} Ray CPUs (cpus_per_trial x workers) but the "
               f"cluster has {cpus}; lower finetune.cpus_per_trial or finetune.workers_per_trial, or add nodes")
        _check(not f.use_gpu or gpus >= workers,
               f"finetune.use_gpu=true needs {workers} GPU(s) per trial but the Ray cluster has {gpus}; add GPU "
               f"nodes, lower finetune.workers_per_trial, or set finetune.use_gpu=false")
