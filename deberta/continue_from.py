"""Pretraining that starts from a released DeBERTa-v2/v3 checkpoint (continued pretraining, domain adaptation).

A released directory holds a transformers state dict: the backbone (`deberta.*`, or bare for a `DebertaV2Model`)
and, depending on what it was released as, an MLM head (`lm_predictions.lm_head.*`, or the legacy
`cls.predictions.*`), the authors' RTD head (`mask_predictions.*`: the released V3 discriminators), and in the
authors' own files an absolute position table (`deberta.embeddings.position_embeddings.weight`: the one their EMD
reads; HF's DebertaV2 never uses it). `read` takes one apart and checks every part against our model's shapes;
`mlm_weights` and `rtd_weights` assemble the state dict of the pretraining model (`DebertaForMaskedLM`,
`deberta.rtd.RTDPretrainer`) with a note per part saying where it came from. What the checkpoint lacks keeps the
model's fresh init: the engine loads a subset of keys (under ZeRO-3 module by module, `training.engine.construct`).

How the parts start (DeBERTa §3.2 and DeBERTaV3 §3 give no continue recipe; these keep the released function):
- the EMD's position table: the checkpoint's when it has one, else zero, so the EMD's first pass is exactly the
  checkpoint's last layer (the second pass is new either way; `emd=False` trains without the EMD, as HF computes);
- an MLM head the checkpoint lacks (a released V3 discriminator has none): newly initialised, and said;
- RTD's generator: a given one (its width and vocabulary must be the discriminator's), else the discriminator's
  embeddings and lower `generator_layers` layers with a new MLM head;
- RTD's word tables per `embedding_sharing`: GDES E_G = the generator's table and E_delta = E_D - E_G (zero for a
  derived generator), so E_G + E_delta is the released discriminator's table; ES one table, the discriminator's;
  NES each its own.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deberta.config import DebertaConfig

WORD_TABLE = "deberta.embeddings.word_embeddings.weight"
AUTHORS_POSITION_TABLE = "deberta.embeddings.position_embeddings.weight"
AUTHORS_GENERATOR_FILE = "pytorch_model.generator.bin"
"""The authors' generator, which microsoft/DeBERTa publishes beside some of its V3 discriminators."""
LM_HEAD = "lm_predictions.lm_head."
RTD_HEAD = "mask_predictions."
_LAYER = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
TRAINING_CHOICES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "attn_impl")
"""Config fields that say how a model trains, not what it is: a generator may differ from its discriminator there."""


@dataclass(frozen=True)
class Released:
    """A released checkpoint taken apart; every tensor fp32 and checked against our model's shapes."""

    config: DebertaConfig
    backbone: dict[str, torch.Tensor]
    """`deberta.*`: our DebertaModel's keys, prefixed as in every task model."""
    lm_head: dict[str, torch.Tensor] = field(default_factory=dict)
    """`lm_predictions.lm_head.*` (either HF layout, renamed), or empty."""
    rtd_head: dict[str, torch.Tensor] = field(default_factory=dict)
    """`mask_predictions.*`, or empty."""
    position_table: torch.Tensor | None = None
    """The authors' absolute position table (max_position_embeddings x H), or None."""
    source: str = ""


def _meta_state(module_factory) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return module_factory().state_dict()


def _checked(part: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, where: str) -> dict:
    """`part` (a head) checked key for key and shape for shape against `want` (a fresh module's state dict)."""
    from deberta.hf import state_mismatch

    if not part:
        return {}
    missing, extra, shapes = state_mismatch(part, want)
    if missing or extra or shapes:
        raise ValueError(f"{where}: its {what} does not fit its config.json: missing {missing[:3]}, unexpected "
                         f"{extra[:3]}, shapes {shapes[:3]}")
    return {k: v.float().contiguous() for k, v in part.items()}


def read(path: str | Path, config: DebertaConfig | None = None, weights_file: str | None = None) -> Released:
    """An HF DeBERTa-v2 directory (or `weights_file` in it, e.g. the authors' generator with `config`) -> Released.
    ValueError naming the directory and the part that does not fit."""
    from transformers import DebertaV2Config

    from deberta import hf
    from deberta.model import DebertaForMaskedLM
    from deberta.rtd import DebertaForReplacedTokenDetection

    path = Path(path)
    if config is None:
        config = hf.from_hf_config(DebertaV2Config.from_pretrained(path, local_files_only=True),
                                   source=str(path / "config.json"))
    state = (torch.load(path / weights_file, map_location="cpu", weights_only=True) if weights_file
             else hf._read_weights(path))
    if any(k.startswith("cls.predictions.") for k in state):  # the legacy MLM head
        state = hf._from_legacy_head(state)
    table = state.get(AUTHORS_POSITION_TABLE, state.get(AUTHORS_POSITION_TABLE.removeprefix("deberta.")))
    if table is not None and tuple(table.shape) != (config.max_position_embeddings, config.hidden_size):
        table = None  # some other use of the name: not an EMD table
    where = str(path / weights_file) if weights_file else str(path)
    mlm = _meta_state(lambda: DebertaForMaskedLM(config, emd=False))
    rtd = _meta_state(lambda: DebertaForReplacedTokenDetection(config))
    return Released(
        config=config,
        backbone=hf._backbone_tensors(state, config, Path(where)),
        lm_head=_checked({k: v for k, v in state.items() if k.startswith(LM_HEAD)},
                         {k: v for k, v in mlm.items() if k.startswith(LM_HEAD)}, "MLM head", where),
        rtd_head=_checked({k: v for k, v in state.items() if k.startswith(RTD_HEAD)},
                          {k: v for k, v in rtd.items() if k.startswith(RTD_HEAD)}, "RTD head", where),
        position_table=None if table is None else table.float().contiguous(),
        source=where,
    )


def check_generator(generator: DebertaConfig, discriminator: DebertaConfig, generator_dir: str | Path,
                    discriminator_dir: str | Path) -> int:
    """The generator's depth, after checking it is the discriminator's model at another depth with the same
    tokenizer (ValueError naming what differs)."""
    differ = [f"{f.name}={getattr(generator, f.name)!r} (discriminator: {getattr(discriminator, f.name)!r})"
              for f in dataclasses.fields(generator)
              if f.name not in (*TRAINING_CHOICES, "num_hidden_layers")
              and getattr(generator, f.name) != getattr(discriminator, f.name)]
    if differ:
        raise ValueError(f"its {', '.join(differ)}: a generator must have the discriminator's width and vocabulary "
                         f"(DeBERTaV3 §3 shares the embedding); give the generator released with it")
    spm = "spm.model"
    if (Path(generator_dir) / spm).read_bytes() != (Path(discriminator_dir) / spm).read_bytes():
        raise ValueError(f"its {spm} differs from the discriminator's: the two were trained with different "
                         f"tokenizers; give the generator released with this discriminator")
    return generator.num_hidden_layers


def generator_bin_layers(init_dir: str | Path, discriminator: DebertaConfig) -> int | None:
    """Depth of the authors' generator beside the discriminator (None when there is none); ValueError if its
    width or vocabulary differs from the discriminator's."""
    file = Path(init_dir) / AUTHORS_GENERATOR_FILE
    if not file.is_file():
        return None
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    layers = {int(m.group(1)) for k in state if (m := _LAYER.search(k))}
    table = state.get(WORD_TABLE, state.get(WORD_TABLE.removeprefix("deberta.")))
    want = (discriminator.vocab_size, discriminator.embedding_dim)
    if table is None or tuple(table.shape) != want or not layers:
        got = None if table is None else tuple(table.shape)
        raise ValueError(f"{file}: word table {got}, need {want} and encoder layers: not a generator of this "
                         f"discriminator")
    return max(layers) + 1


def read_generator(init_dir: str | Path, discriminator: DebertaConfig, layers: int) -> Released | None:
    """The authors' pytorch_model.generator.bin beside the discriminator, or None."""
    if not (Path(init_dir) / AUTHORS_GENERATOR_FILE).is_file():
        return None
    return read(init_dir, discriminator.replace(num_hidden_layers=layers), AUTHORS_GENERATOR_FILE)


def _emd_table(released: Released, notes: dict[str, str], key: str) -> torch.Tensor:
    if released.position_table is not None:
        notes[key] = f"{AUTHORS_POSITION_TABLE} of the checkpoint"
        return released.position_table
    notes[key] = "zero (none in the checkpoint): the EMD's first pass is the checkpoint's last layer"
    c = released.config
    return torch.zeros(c.max_position_embeddings, c.hidden_size)


def mlm_weights(released: Released, emd: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """DebertaForMaskedLM's state dict (a subset: what the checkpoint gives) and where each part came from."""
    weights = dict(released.backbone)
    notes = {"backbone": "loaded"}
    if released.lm_head:
        weights.update(released.lm_head)
        notes["lm_head"] = "loaded"
    else:
        notes["lm_head"] = "new (the checkpoint has none: a released discriminator or bare model)"
    if emd:
        weights["emd.position_embeddings.weight"] = _emd_table(released, notes, "emd_table")
    return weights, notes


def rtd_weights(discriminator: Released, generator: Released | None, generator_layers: int, sharing: str,
                emd: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """RTDPretrainer's state dict (a subset) from a released discriminator and, if given, its generator."""
    weights = {f"discriminator.{k}": v for k, v in discriminator.backbone.items()}
    notes = {"discriminator": "loaded"}
    if discriminator.rtd_head:
        weights.update({f"discriminator.{k}": v for k, v in discriminator.rtd_head.items()})
        notes["rtd_head"] = "loaded"
    else:
        notes["rtd_head"] = "new (the checkpoint has none)"
    if generator is None:
        def lower(key: str) -> bool:
            m = _LAYER.search(key)
            return m is None or int(m.group(1)) < generator_layers

        generator = Released(discriminator.config.replace(num_hidden_layers=generator_layers),
                             {k: v for k, v in discriminator.backbone.items() if lower(k)},
                             position_table=discriminator.position_table, source=discriminator.source)
        notes["generator"] = (f"derived: the discriminator's embeddings and lower {generator_layers} layers, "
                              f"a new MLM head")
    else:
        notes["generator"] = f"loaded from {generator.source}" + ("" if generator.lm_head else ", a new MLM head")
    mlm, gen_notes = mlm_weights(generator, emd)
    weights.update({f"generator.{k}": v for k, v in mlm.items()})
    notes.update({f"generator_{k}": v for k, v in gen_notes.items() if k != "backbone"})
    e_d, e_g = discriminator.backbone[WORD_TABLE], generator.backbone[WORD_TABLE]
    if sharing == "es":
        e_g = e_d
        notes["embeddings"] = "es: one table, the discriminator's"
    elif sharing == "gdes":
        e_d = e_d - e_g
        notes["embeddings"] = "gdes: E_G the generator's table, E_delta = E_D - E_G" + (
            " = 0" if notes["generator"].startswith("derived") else "")
    else:
        notes["embeddings"] = "nes: each its own table"
    weights[f"generator.{WORD_TABLE}"], weights[f"discriminator.{WORD_TABLE}"] = e_g, e_d
    return weights, notes
