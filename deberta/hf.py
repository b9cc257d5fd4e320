"""Import from / export to HF `transformers` DeBERTa-v2 (`DebertaV2Model`, `DebertaV2ForMaskedLM` with
`legacy=False`, and every task head of `deberta.heads` as the HF class it names: `DebertaV2ForSequenceClassification`,
`DebertaV2ForTokenClassification`, `DebertaV2ForQuestionAnswering`, `DebertaV2ForMultipleChoice`), tokenizer
included.

Our parameter names are HF's, so conversion is a state-dict copy; the only keys that differ are ours
alone: the EMD's absolute position table (`emd.position_embeddings`), which HF has no place for. It is
dropped on export (an exported MLM carries backbone + LM head) and freshly initialised on import.

An exported directory is whole: `config.json` (with `architectures`, and labels for a classifier),
`model.safetensors`, the tokenizer (`tokenizer.json`, `tokenizer_config.json`, plus the vocab stage's own
`spm.model` and `special_tokens.json`) and a model card, so `AutoTokenizer` / `AutoModel*` / `pipeline` load
it offline and the tokenizer gives our ids. `load_backbone` reads any HF DeBERTa-v2 directory back into our
config + backbone weights, to fine-tune from.

`transformers` (and `sentencepiece`, `safetensors`) are imported lazily, inside these functions: the rest of
`deberta/` needs torch only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from deberta.config import DebertaConfig
from deberta.heads import (DebertaForQuestionAnswering, DebertaForSequenceClassification,
                           DebertaForTokenClassification, TaskHead)
from deberta.model import DebertaForMaskedLM, DebertaModel

# Keys that exist only in our models (HF has no EMD).
OURS_ONLY_PREFIXES = ("emd.",)
BACKBONE_PREFIX = "deberta."
# HF settings our architecture fixes (relative attention only, no absolute positions at the input, GELU, no token
# types): anything else cannot be imported faithfully.
_FIXED = {
    "relative_attention": True,
    "position_biased_input": False,
    "hidden_act": "gelu",
    "type_vocab_size": 0,
}
# The vocab stage's files and id layout (core/tokenizer.py; deberta/ may not import the pipeline).
SPM_FILE, SPECIAL_FILE = "spm.model", "special_tokens.json"
PAD, CLS, SEP, UNK, MASK = "[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"
FIXED_IDS = {PAD: 0, CLS: 1, SEP: 2, UNK: 3}
NOT_A_TOKEN_BIAS = -1e4
"""LM-head bias given to embedding rows past the tokenizer (the padding up to a multiple of 100): no text maps to
them, and an HF fill-mask top-k that picked one would answer an empty string. -1e4 is finite in fp16 and bf16."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


def to_hf_config(cfg: DebertaConfig, **extra: Any):
    """Our config -> `transformers.DebertaV2Config` (HF defaults differ from ours: every knob is set).

    A factorised embedding (E != H) needs HF's legacy MLM head (`legacy=True`, `cls.predictions.*`): its
    legacy=False head cannot multiply by a V x E table. Shared layers have no HF form and are refused."""
    from transformers import DebertaV2Config

    if cfg.share_layers != "none":
        raise ValueError(f"to_hf_config: share_layers={cfg.share_layers!r} has no HF DebertaV2 form (every HF layer "
                         f"owns its weights); export the unshared copy instead: build the model with "
                         f"cfg.replace(share_layers='none') and load deberta.model.unshared_state_dict(state, cfg) "
                         f"(the same outputs, the shared weights copied into every layer)")
    return DebertaV2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        embedding_size=cfg.embedding_dim,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        layer_norm_eps=cfg.layer_norm_eps,
        max_relative_positions=cfg.max_relative_positions,
        pad_token_id=cfg.pad_token_id,
        pos_att_type=["p2c", "c2p"],
        position_buckets=cfg.position_buckets if cfg.position_buckets > 0 else -1,
        share_att_key=cfg.share_att_key,
        norm_rel_ebd="layer_norm" if cfg.norm_rel_ebd else "none",
        conv_kernel_size=cfg.conv_kernel_size,
        conv_act="gelu",
        legacy=cfg.factorised_embedding,
        **_FIXED,
        **extra,
    )


def from_hf_config(hf_cfg, source: str = "from_transformers") -> DebertaConfig:
    """`transformers.DebertaV2Config` -> our config; refuses features our model does not implement, naming the field
    (`source` prefixes the message: the function or file the config came from)."""
    def refuse(field: str, got: Any, need: str) -> ValueError:
        return ValueError(f"{source}: config.{field}={got!r} is not supported (need {need}); our DeBERTa "
                          f"implements the DeBERTa-v2/v3 architecture only")

    if getattr(hf_cfg, "model_type", "deberta-v2") != "deberta-v2":
        raise refuse("model_type", hf_cfg.model_type, "'deberta-v2'")
    for key, want in _FIXED.items():
        got = getattr(hf_cfg, key, None)
        if got != want:
            raise refuse(key, got, repr(want))
    pos_att = set(getattr(hf_cfg, "pos_att_type", None) or [])
    if pos_att != {"p2c", "c2p"}:
        raise refuse("pos_att_type", sorted(pos_att), "['c2p', 'p2c']")
    embedding_size = getattr(hf_cfg, "embedding_size", None)
    head_size = getattr(hf_cfg, "attention_head_size", None)
    if head_size not in (None, hf_cfg.hidden_size // hf_cfg.num_attention_heads):
        raise refuse("attention_head_size", head_size, "hidden_size / num_attention_heads")
    conv = getattr(hf_cfg, "conv_kernel_size", 0)
    if conv > 0 and getattr(hf_cfg, "conv_act", "tanh") != "gelu":
        raise refuse("conv_act", getattr(hf_cfg, "conv_act", "tanh"), "'gelu'")
    if conv > 0 and getattr(hf_cfg, "conv_groups", 1) != 1:
        raise refuse("conv_groups", hf_cfg.conv_groups, "1")
    norm = [x.strip() for x in str(getattr(hf_cfg, "norm_rel_ebd", "none")).lower().split("|")]
    buckets = getattr(hf_cfg, "position_buckets", -1)
    return DebertaConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        embedding_size=0 if embedding_size in (None, hf_cfg.hidden_size) else embedding_size,
        num_hidden_layers=hf_cfg.num_hidden_layers,
        num_attention_heads=hf_cfg.num_attention_heads,
        intermediate_size=hf_cfg.intermediate_size,
        hidden_dropout_prob=hf_cfg.hidden_dropout_prob,
        attention_probs_dropout_prob=hf_cfg.attention_probs_dropout_prob,
        max_position_embeddings=hf_cfg.max_position_embeddings,
        position_buckets=buckets if buckets > 0 else 0,
        max_relative_positions=getattr(hf_cfg, "max_relative_positions", -1),
        share_att_key=bool(getattr(hf_cfg, "share_att_key", False)),
        conv_kernel_size=conv,
        norm_rel_ebd="layer_norm" in norm,
        layer_norm_eps=hf_cfg.layer_norm_eps,
        pad_token_id=hf_cfg.pad_token_id if hf_cfg.pad_token_id is not None else 0,
        initializer_range=hf_cfg.initializer_range,
    )


def _copy_state(src: dict[str, torch.Tensor], dst: nn.Module, skip_missing: tuple[str, ...]) -> None:
    """Copy every tensor of `src` into `dst` by name; every dst key must be covered except `skip_missing`."""
    dst_state = dst.state_dict()
    missing = [k for k in dst_state if k not in src and not k.startswith(skip_missing)]
    if missing:
        raise ValueError(f"checkpoint conversion: missing parameters {missing[:8]} (of {len(missing)})")
    with torch.no_grad():
        for name, tensor in dst_state.items():
            if name in src:
                if src[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint conversion: {name} has shape {tuple(src[name].shape)}, "
                                     f"expected {tuple(tensor.shape)}")
                tensor.copy_(src[name])


# Our LM head under HF's legacy names (E != H exports; the decoder is tied to the word table, its bias to the bias).
LEGACY_HEAD = {"lm_predictions.lm_head.dense.": "cls.predictions.transform.dense.",
               "lm_predictions.lm_head.LayerNorm.": "cls.predictions.transform.LayerNorm.",
               "lm_predictions.lm_head.bias": "cls.predictions.bias"}


def _rename(state: dict[str, torch.Tensor], table: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        src = next((s for s in table if k.startswith(s)), None)
        out[k if src is None else table[src] + k[len(src):]] = v
    return out


def _to_legacy_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = _rename(state, LEGACY_HEAD)
    out["cls.predictions.decoder.weight"] = out[BACKBONE_PREFIX + "embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def _from_legacy_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    kept = {k: v for k, v in state.items() if not k.startswith("cls.predictions.decoder.")}  # tied copies
    return _rename(kept, {v: k for k, v in LEGACY_HEAD.items()})


def _hf_state(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    # HF's non-persistent `position_ids` buffer has no counterpart in ours (we hold no absolute table)
    return {k: v for k, v in hf_model.state_dict().items() if not k.endswith("position_ids")}


def from_transformers(hf_model: nn.Module) -> nn.Module:
    """HF DebertaV2Model / DebertaV2ForMaskedLM(legacy=False) / DebertaV2For{Sequence,Token}Classification /
    DebertaV2ForQuestionAnswering -> ours.

    An imported MLM gets a freshly initialised EMD position table (HF checkpoints have none).
    """
    name = type(hf_model).__name__
    cfg = from_hf_config(hf_model.config)
    state = _hf_state(hf_model)
    if name == "DebertaV2Model":
        model: nn.Module = DebertaModel(cfg)
        _copy_state(state, model, ())
    elif name == "DebertaV2ForMaskedLM":
        if hf_model.config.legacy and not cfg.factorised_embedding:
            raise ValueError("from_transformers: legacy=True MLM heads (cls.predictions.*) are not supported; "
                             "use DebertaV2ForMaskedLM with legacy=False")
        if hf_model.config.legacy:  # E != H: the legacy head is ours (dense H -> E, LayerNorm(E), tied decoder)
            state = _from_legacy_head(state)
        model = DebertaForMaskedLM(cfg)
        _copy_state(state, model, OURS_ONLY_PREFIXES)
    elif name == "DebertaV2ForTokenClassification":
        model = DebertaForTokenClassification(cfg, hf_model.config.num_labels, _cls_dropout(hf_model.config))
        _copy_state(state, model, ())
    elif name == "DebertaV2ForQuestionAnswering":
        model = DebertaForQuestionAnswering(cfg, _cls_dropout(hf_model.config))
        _copy_state(state, model, ())
    elif name == "DebertaV2ForSequenceClassification":
        hc = hf_model.config
        cls_dropout = getattr(hc, "cls_dropout", None)
        model = DebertaForSequenceClassification(
            cfg,
            num_labels=hc.num_labels,
            classifier_dropout=hc.hidden_dropout_prob if cls_dropout is None else cls_dropout,
            pooler_dropout=hc.pooler_dropout,
        )
        _copy_state(state, model, ())
    else:
        raise TypeError(f"from_transformers: unsupported model class {name}")
    return model


def _cls_dropout(hc) -> float:
    """The task-layer dropout of an HF head config (`cls_dropout`, else the hidden dropout, as HF's heads)."""
    cls_dropout = getattr(hc, "cls_dropout", None)
    return hc.hidden_dropout_prob if cls_dropout is None else cls_dropout


def to_transformers(model: nn.Module, labels: Sequence[str] | None = None,
                    drop_sift_normalisation: bool = False) -> nn.Module:
    """Ours -> the matching HF model (eval-ready copy). The EMD position table is not exported.

    labels: a classifier's class names (index = class id) for `id2label`; None gives LABEL_i ("score" for regression).
    drop_sift_normalisation: export a sift=True classifier without its extra (affine-free) embedding normalisation,
    which HF has no place for. LayerNorm(LayerNorm0(x)) and LayerNorm(x) differ by the per-token factor
    1/sqrt(1 + eps - eps/(var(x) + eps)), a relative eps/(2 var(x)): 1.25e-4 for embeddings of std 0.02.
    """
    import transformers as tf

    if isinstance(model, TaskHead):  # a task head names its HF class and its config fields (`deberta.heads`)
        if model.deberta.embeddings.sift and not drop_sift_normalisation:
            raise ValueError("to_transformers: this head was built with sift=True, which normalises word "
                             "embeddings before the embedding LayerNorm and HF DebertaV2 cannot; pass "
                             "drop_sift_normalisation=True to export it without (outputs move by about "
                             "layer_norm_eps / (2 var(embedding)), relative)")
        hf_model = getattr(tf, model.hf_class)(to_hf_config(model.cfg, **model.hf_config(labels)))
    elif isinstance(model, DebertaForMaskedLM):
        hf_model = tf.DebertaV2ForMaskedLM(to_hf_config(model.cfg))
    elif isinstance(model, DebertaModel):
        hf_model = tf.DebertaV2Model(to_hf_config(model.cfg))
    else:
        raise TypeError(f"to_transformers: unsupported model class {type(model).__name__}")
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith(OURS_ONLY_PREFIXES)}
    if isinstance(model, DebertaForMaskedLM) and hf_model.config.legacy:
        ours = _to_legacy_head(ours)
    _copy_state(ours, hf_model, ())
    return hf_model.eval()


# ----------------------------------------------------------------------------------------------- the tokenizer

def read_vocab(vocab_dir: str | Path):
    """The SentencePiece ModelProto of a vocab directory (spm.model + special_tokens.json, as the vocab stage
    writes them), checked against our id layout: [PAD] [CLS] [SEP] [UNK] = 0..3, [MASK] = number of pieces."""
    from sentencepiece import sentencepiece_model_pb2

    vocab_dir = Path(vocab_dir)
    missing = [name for name in (SPM_FILE, SPECIAL_FILE) if not (vocab_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"no {' or '.join(missing)} in {vocab_dir}; pass the vocab stage's artifact directory "
                                f"(or a model's tokenizer/ folder, which holds copies of both)")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString((vocab_dir / SPM_FILE).read_bytes())
    except Exception as e:  # protobuf raises DecodeError, or RuntimeWarning-like errors on truncation
        raise ValueError(f"{vocab_dir / SPM_FILE} is not a SentencePiece model ({e}); re-run the vocab stage") from None
    want = {**FIXED_IDS, MASK: len(proto.pieces)}
    found = {p.piece: i for i, p in enumerate(proto.pieces[:len(FIXED_IDS)])}
    special = json.loads((vocab_dir / SPECIAL_FILE).read_text())
    if found != FIXED_IDS or special != want:
        raise ValueError(f"{vocab_dir}: special ids {special} (pieces 0..3: {list(found)}) differ from our layout "
                         f"{want}; the vocab stage writes that layout - retrain the vocabulary with it")
    return proto


def _normalizer(charsmap: bytes):
    """SentencePiece's normalisation (its charsmap, then whitespace clean-up) as a `tokenizers` normalizer.

    The dummy prefix of a text that starts with spaces is written here ("  a" -> "_a"), not left to Metaspace:
    Metaspace(prepend_scheme="first") prepends only where the normalised text still begins at original offset 0,
    which removing the spaces breaks. The same rule gives a word after [MASK] its "_", as SentencePiece does.
    """
    from tokenizers import Regex, normalizers

    steps = [normalizers.Precompiled(charsmap)] if charsmap else []
    steps += [
        normalizers.Replace(Regex(r" +\z"), ""),
        normalizers.Replace(Regex(r"\A +"), "\u2581"),
        normalizers.Replace(Regex(" {2,}"), " "),
        normalizers.Replace(" ", "\u2581"),
    ]
    return normalizers.Sequence(steps)


def build_tokenizer(vocab_dir: str | Path, model_max_length: int):
    """Our tokenizer (vocab directory: spm.model + special_tokens.json) as a `transformers` fast tokenizer.

    Same ids as SentencePiece (byte fallback, NFKC charsmap and whitespace rules included), [MASK] appended as id
    `pieces`, `[CLS] a [SEP] (b [SEP])` added around the text. A unigram model's Viterbi sums scores in float32 in
    SentencePiece and in float64 in `tokenizers`, so near-ties can split differently (measured on news text: 1 in
    10,394 sentences; more often in texts of thousands of pieces). Literal "[PAD]" ... "[MASK]" in a text are read
    as those tokens (HF's rule, which fill-mask needs); SentencePiece reads them as text.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = read_vocab(vocab_dir)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    off = [f for f in ("add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces") if not getattr(spec, f)]
    if off or trainer.model_type not in (1, 2):  # UNIGRAM, BPE
        raise ValueError(f"{vocab_dir}/{SPM_FILE}: normalizer_spec {off} off / model_type {trainer.model_type} is "
                         f"not what the vocab stage trains (unigram or bpe, default whitespace rules)")
    if trainer.model_type == 1:
        # SentencePiece emits byte pieces only as fallback; a `tokenizers` Unigram would also match the literal
        # text "<0x41>" with them. A score below any path of learned pieces keeps them out wherever "<" and ">"
        # have pieces; where they have none, the unknown-character path sits at the same floor and the byte piece
        # still wins (a vocabulary without "<" rarely meets "<0x..>" text).
        floor = min(p.score for p in proto.pieces if p.type == 1) * len(proto.pieces)
        vocab: Any = [(p.piece, floor if p.type == 6 else p.score) for p in proto.pieces]  # 6: BYTE
    else:  # BPE merges are regenerated from the piece scores, as SentencePiece ranks them
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=False)
    backend.normalizer = _normalizer(spec.precompiled_charsmap)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0", pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, FIXED_IDS[CLS]), (SEP, FIXED_IDS[SEP])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, cls_token=CLS, sep_token=SEP, unk_token=UNK, mask_token=MASK,
        bos_token=CLS, eos_token=SEP, model_max_length=model_max_length, padding_side="right")
    if len(tok) != len(proto.pieces) + 1 or tok.mask_token_id != len(proto.pieces):
        raise RuntimeError(f"build_tokenizer: [MASK] got id {tok.mask_token_id} and length {len(tok)}, "
                           f"expected {len(proto.pieces)} and {len(proto.pieces) + 1}")
    return tok


def save_tokenizer(vocab_dir: str | Path, out: str | Path, model_max_length: int) -> Path:
    """Write the tokenizer into an HF directory: tokenizer.json + tokenizer_config.json, and the vocab stage's
    spm.model + special_tokens.json (so the directory is also a vocab directory for our own Tokenizer)."""
    out = Path(out)
    build_tokenizer(vocab_dir, model_max_length).save_pretrained(out)
    # "PreTrainedTokenizerFast" loads tokenizer.json as it is in transformers 4 and 5 alike; without a
    # tokenizer_class, AutoTokenizer builds DebertaV2Tokenizer, which rebuilds normalizer and model (no byte fallback)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in (SPM_FILE, SPECIAL_FILE):
        shutil.copyfile(Path(vocab_dir) / name, out / name)
    return out


# ----------------------------------------------------------------------------------------------- export

def _mask_rows_past_tokenizer(hf_model: nn.Module, tokenizer_len: int) -> None:
    with torch.no_grad():
        bias = hf_model.cls.predictions.bias if hf_model.config.legacy else hf_model.lm_predictions.lm_head.bias
        bias[tokenizer_len:] = NOT_A_TOKEN_BIAS  # legacy: decoder.bias is the same tensor


def _model_card(path: Path, hf_model: nn.Module, pipeline_tag: str, tokenizer_len: int, notes: list[str]) -> None:
    cfg = hf_model.config
    params = sum(p.numel() for p in hf_model.parameters())
    lines = [
        "---", "library_name: transformers", f"pipeline_tag: {pipeline_tag}", "tags:", "- deberta-v2", "---", "",
        f"# {type(hf_model).__name__}", "",
        "DeBERTa (disentangled attention) trained by this repository's pipeline and exported by `deberta.hf`.", "",
        f"- {cfg.num_hidden_layers} layers x {cfg.hidden_size}, {cfg.num_attention_heads} heads, {params:,} parameters",
        f"- tokenizer: SentencePiece ({tokenizer_len - 1} pieces) + [MASK]={tokenizer_len - 1}; "
        f"{cfg.vocab_size} embedding rows",
        "- the pretraining's Enhanced Mask Decoder is not part of this export: HF has no place for it",
        *(f"- {n}" for n in notes),
    ]
    (path / "README.md").write_text("\n".join(lines) + "\n")


def save_pretrained(model: nn.Module, path: str | Path, *, vocab_dir: str | Path,
                    labels: Sequence[str] | None = None, model_max_length: int | None = None,
                    drop_sift_normalisation: bool = False, config_extra: dict[str, Any] | None = None) -> Path:
    """Write a whole HF directory: config.json, model.safetensors, tokenizer, README.md.

    `transformers.AutoModel` / `AutoModelForMaskedLM` / `AutoModelForSequenceClassification`, `AutoTokenizer` and
    `pipeline("fill-mask" | "text-classification")` load it offline.
    vocab_dir: the vocab stage's directory (spm.model + special_tokens.json) the model was trained with.
    labels: a classifier's class names, index = class id (the task's labels; None/empty for regression).
    model_max_length: the tokenizer's truncation length (fine-tuning: its max_seq_len); default: the model's
    max_position_embeddings.
    config_extra: fields added to config.json (transformers keeps unknown fields), for what serves the model.
    """
    tokenizer_len = len(read_vocab(vocab_dir).pieces) + 1
    if tokenizer_len > model.cfg.vocab_size:
        raise ValueError(f"save_pretrained: the tokenizer in {vocab_dir} has {tokenizer_len} ids but the model only "
                         f"{model.cfg.vocab_size} embedding rows; export it with the vocabulary it was trained with")
    hf_model = to_transformers(model, labels, drop_sift_normalisation)
    for key, value in (config_extra or {}).items():  # settings the serving side reads (e.g. a QA threshold)
        setattr(hf_model.config, key, value)
    notes = []  # what this export holds besides the backbone: the card says what the model itself says
    if isinstance(model, DebertaForMaskedLM):
        _mask_rows_past_tokenizer(hf_model, tokenizer_len)
        notes.append(f"LM-head bias of rows {tokenizer_len}..{model.cfg.vocab_size - 1} (no token) set to "
                     f"{NOT_A_TOKEN_BIAS:g}")
    if isinstance(model, TaskHead) and "id2label" in model.hf_config(labels):  # a head whose outputs are labels
        notes.append(f"labels: {hf_model.config.id2label} ({hf_model.config.problem_type})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(vocab_dir, path, model_max_length or model.cfg.max_position_embeddings)
    hf_model.save_pretrained(path)
    tag = "fill-mask" if isinstance(model, DebertaForMaskedLM) else getattr(model, "pipeline_tag", "feature-extraction")
    _model_card(path, hf_model, tag, tokenizer_len, notes)
    return path


# ----------------------------------------------------------------------------------------------- import

@dataclass(frozen=True)
class ImportedBackbone:
    """An HF DeBERTa-v2 directory read back: what fine-tuning needs to start from it."""

    config: DebertaConfig
    """Our config, converted field by field from config.json."""
    state_dict: dict[str, torch.Tensor]
    """fp32 backbone weights under `deberta.*` (our DebertaModel's keys, prefixed as in every task model)."""
    source: Path
    """The directory it came from; it holds the tokenizer's spm.model."""

    @property
    def tokenizer_length(self) -> int:
        """SentencePiece pieces + [MASK]."""
        from sentencepiece import SentencePieceProcessor

        return SentencePieceProcessor(model_file=str(self.source / SPM_FILE)).vocab_size() + 1

    def write_vocab(self, dst: str | Path) -> Path:
        """Write dst/spm.model + dst/special_tokens.json (the vocab stage's layout) from the directory's tokenizer."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.source / SPM_FILE, dst / SPM_FILE)
        special = {**FIXED_IDS, MASK: self.tokenizer_length - 1}
        (dst / SPECIAL_FILE).write_text(json.dumps(special, indent=2) + "\n")
        read_vocab(dst)  # the layout check
        return dst


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory: model.safetensors, pytorch_model.bin, or their sharded index."""
    from safetensors.torch import load_file

    def load(file: Path) -> dict[str, torch.Tensor]:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)

    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(file.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load(path / shard))
            return state
        return load(file)
    raise FileNotFoundError(f"no weights in {path} (looked for {', '.join(WEIGHT_FILES)}); point at a directory "
                            f"written by save_pretrained")


def state_mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[list, list, list]:
    """(keys `want` has and `got` lacks, keys only `got` has, "key (got) vs (want)" for shapes that differ)."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(want[k].shape)}"
              for k in sorted(set(want) & set(got)) if got[k].shape != want[k].shape]
    return missing, extra, shapes


def _backbone_tensors(state: dict[str, torch.Tensor], cfg: DebertaConfig, where: Path) -> dict[str, torch.Tensor]:
    """`deberta.*` fp32 tensors checked key for key and shape for shape against our DebertaModel(cfg)."""
    # a bare DebertaV2Model saves "embeddings.*"/"encoder.*"; task models prefix "deberta."
    bare = not any(k.startswith(BACKBONE_PREFIX) for k in state)
    tensors = {(BACKBONE_PREFIX + k if bare else k): v for k, v in state.items()}
    # buffers HF itself ignores: position ids, and the absolute table old checkpoints keep without using it
    ignored = ("position_ids", "embeddings.position_embeddings.weight")
    tensors = {k: v for k, v in tensors.items() if k.startswith(BACKBONE_PREFIX) and not k.endswith(ignored)}
    with torch.device("meta"):
        want = {BACKBONE_PREFIX + k: v for k, v in DebertaModel(cfg, _init=False).state_dict().items()}
    missing, extra, shapes = state_mismatch(tensors, want)
    if missing or extra or shapes:
        raise ValueError(f"{where}: the weights do not fit its config.json: missing {missing[:5]}, unexpected "
                         f"{extra[:5]}, shapes {shapes[:5]}; the checkpoint and its config do not belong together")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def load_backbone(path: str | Path) -> ImportedBackbone:
    """Read any HF DebertaV2 directory (config.json + safetensors/bin weights + the tokenizer's spm.model) into
    our DebertaConfig + backbone state dict, to fine-tune from. Task heads in the checkpoint are left behind.

    Unsupported configurations are refused with one message naming the config field.
    """
    from transformers import DebertaV2Config

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}; point at an HF model directory (save_pretrained output)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != "deberta-v2":
        raise ValueError(f"{config_file}: config.model_type={model_type!r} is not supported (need 'deberta-v2')")
    cfg = from_hf_config(DebertaV2Config.from_pretrained(path, local_files_only=True), source=str(config_file))
    if not (path / SPM_FILE).is_file():
        raise FileNotFoundError(f"no {SPM_FILE} in {path}: fine-tuning tokenises with the model's SentencePiece "
                                f"model; copy the one it was trained with into the directory")
    imported = ImportedBackbone(cfg, _backbone_tensors(_read_weights(path), cfg, path), path)
    _check_tokenizer(imported)
    return imported


def _check_tokenizer(imported: ImportedBackbone) -> None:
    """The directory's spm.model must have our id layout, and [MASK] (if the tokenizer names it) id = pieces."""
    from sentencepiece import SentencePieceProcessor

    try:
        sp = SentencePieceProcessor(model_file=str(imported.source / SPM_FILE))
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{imported.source / SPM_FILE} is not a SentencePiece model ({e}); copy the model's own "
                         f"spm.model into the directory") from None
    found = {sp.id_to_piece(i): i for i in range(min(len(FIXED_IDS), sp.vocab_size()))}
    if found != FIXED_IDS:
        raise ValueError(f"{imported.source / SPM_FILE}: pieces 0..3 are {list(found)}, need {list(FIXED_IDS)} "
                         f"(the DeBERTa-v2/v3 layout our tokenizer assumes)")
    config_file = imported.source / "tokenizer_config.json"
    added = json.loads(config_file.read_text()).get("added_tokens_decoder", {}) if config_file.is_file() else {}
    mask_ids = [int(i) for i, t in added.items() if (t.get("content") if isinstance(t, dict) else t) == MASK]
    if any(i != sp.vocab_size() for i in mask_ids):
        raise ValueError(f"{config_file}: [MASK] has id {mask_ids[0]}, ours is appended after the {sp.vocab_size()} "
                         f"SentencePiece pieces; this tokenizer cannot be reproduced")
    if sp.vocab_size() + 1 > imported.config.vocab_size:
        raise ValueError(f"{imported.source}: the tokenizer has {sp.vocab_size() + 1} ids but config.vocab_size="
                         f"{imported.config.vocab_size}; the directory's tokenizer and model do not belong together")
