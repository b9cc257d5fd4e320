"""A "released" DeBERTa checkpoint written by plain `transformers` (never by our exporter), for the continued-
pretraining tests: a SentencePiece model trained with the DeBERTa-v3 id layout on real text (the gensim wheel's Lee
corpus), saved through `DebertaV2Tokenizer`, and `DebertaV2ForMaskedLM` / `DebertaV2Model` directories beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

LEE = "test/test_data/lee_background.cor"


def lee_text() -> str:
    import gensim

    return (Path(gensim.__file__).parent / LEE).read_text(encoding="utf-8", errors="replace")


def spm_model(root: Path, pieces: int = 600) -> Path:
    """spm.model with DeBERTa-v3's layout: [PAD] [CLS] [SEP] [UNK] = 0..3 ([MASK] is added by the tokenizer)."""
    import sentencepiece as spm

    root.mkdir(parents=True, exist_ok=True)
    (root / "lee.txt").write_text(lee_text())
    spm.SentencePieceTrainer.train(input=str(root / "lee.txt"), model_prefix=str(root / "spm"), vocab_size=pieces,
                                   pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]",
                                   eos_piece="[SEP]", unk_piece="[UNK]", minloglevel=2, num_threads=1)
    return root / "spm.model"


def hf_config(vocab_rows: int, layers: int = 2, hidden: int = 64):
    from transformers import DebertaV2Config

    # deberta-v3's layout at a CPU size: relative attention with log buckets, shared keys, LayerNorm'd table
    return DebertaV2Config(vocab_size=vocab_rows, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=4 * hidden, max_position_embeddings=128, relative_attention=True,
                           position_buckets=32, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                           norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
                           type_vocab_size=0, pad_token_id=0, hidden_act="gelu", legacy=False)


def save_released(out: Path, model, spm: Path) -> Path:
    """model.save_pretrained + the tokenizer saved by transformers, and the spm.model it was built from (released
    DeBERTa-v2/v3 directories ship one; transformers 5 writes only tokenizer.json)."""
    from transformers import DebertaV2Tokenizer

    model.save_pretrained(out)
    src = out.parent / f".{out.name}-tok"
    src.mkdir(exist_ok=True)
    shutil.copy(spm, src / "spm.model")
    DebertaV2Tokenizer.from_pretrained(src).save_pretrained(out)
    shutil.copy(spm, out / "spm.model")
    return out


def released(root: Path, kind: str = "mlm", layers: int = 2, seed: int = 0) -> Path:
    """root/<kind>: "mlm" (DebertaV2ForMaskedLM), "model" (DebertaV2Model: a discriminator without heads)."""
    import torch
    from transformers import DebertaV2ForMaskedLM, DebertaV2Model

    spm = root / "spm.model" if (root / "spm.model").is_file() else spm_model(root)
    torch.manual_seed(seed)
    cfg = hf_config(vocab_rows=700, layers=layers)
    model = (DebertaV2ForMaskedLM if kind == "mlm" else DebertaV2Model)(cfg).eval()
    return save_released(root / f"{kind}-{layers}", model, spm)
