"""Continued pretraining (`pretrain.init`): starting from a released DeBERTa-v2/v3 checkpoint instead of random
weights.

`prepare` decides, once, on the driver before Ray starts, what the checkpoint implies for the run: the [model] section
is its config.json, the [vocab] size its tokenizer's, the vocab stage copies that tokenizer instead of training one,
the objective takes what else the checkpoint decides (`Objective.continued_config`: RTD's generator depth), and the
pretrain stage reads the checkpoint (and `generator_init`) as inputs whose digests its artifact id builds on.

In the stage, the objective assembles its starting weights from the checkpoint (`Objective.initial_weights`, through
`deberta.continue_from`); `initial_weights` checks them against the model key for key on the meta device and writes
them once per artifact as a safetensors file, which every worker maps (`SafetensorsFile`): under ZeRO-3 each rank
copies one module's tensors at a time (`training.engine.construct`). `init_tags` is the run's lineage: the
checkpoints it started from and where each part of the model came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import ConfigError, PipelineConfig, PretrainConfig, apply_overrides
from core.errors import StageInputError
from stages.base import Prepared
from stages.pretrain.objective import Objective
from stages.pretrain.objectives import objective_for

if TYPE_CHECKING:
    import torch

    from deberta.config import DebertaConfig

CHANGED_STAGES = ("vocab", "tokenize", "pretrain")
"""The stages a released checkpoint changes: its tokenizer is the vocab stage's, so every stage from there on."""
INIT_WEIGHTS_FILE = "init-weights.safetensors"
"""The starting weights in the stage's scratch directory: written once, read by every worker."""


def prepare(cfg: PretrainConfig, *, model: DebertaConfig, planned: Collection[str], workdir: Path,
            overrides: Sequence[str]) -> Prepared:
    """`pretrain.init` and `generator_init` resolved (a registry version downloaded into the workdir) and what they
    imply (the module's docstring); nothing without `init`, or when the run plans none of `CHANGED_STAGES`. A
    `--set model.*` that contradicts the checkpoint's config.json is refused, except the training choices."""
    if not cfg.init or not set(planned) & set(CHANGED_STAGES):
        return Prepared()
    from core.init_checkpoint import resolve_init
    from deberta import continue_from  # torch: only for a run that continues a checkpoint

    objects = {key: resolve_init(value, workdir, key=f"pretrain.{key}")
               for key, value in (("init", cfg.init), ("generator_init", cfg.generator_init)) if value}
    init = objects["init"]
    released = init.config()
    asked = apply_overrides(PipelineConfig(preset="", model=released),
                            [o for o in overrides if o.startswith("model.")]).model
    clash = [f"model.{f.name}={getattr(asked, f.name)!r} (config.json: {getattr(released, f.name)!r})"
             for f in dataclasses.fields(released)
             if f.name not in continue_from.TRAINING_CHOICES and getattr(asked, f.name) != getattr(released, f.name)]
    if clash:
        raise ConfigError(f"{', '.join(clash)} contradicts pretrain.init={init.source}: continued pretraining keeps "
                          f"the checkpoint's architecture; drop the --set")
    decided = objective_for(cfg).continued_config(released, init.path, objects.get("generator_init"))
    return Prepared(
        objects=objects,
        config={"model": {f.name: getattr(asked, f.name) for f in dataclasses.fields(asked)},
                "vocab": {"vocab_size": init.tokenizer_length() - 1}, "pretrain": decided},
        adds={"pretrain": tuple(objects)}, replaces={"vocab": ("init",)},
        notes={"vocab": "the tokenizer of pretrain.init"})


def initial_weights(objective: Objective, model: "DebertaConfig", inputs: dict, scratch: Path) -> tuple[str, dict]:
    """Continued pretraining: the objective's starting weights from `pretrain.init` (and `generator_init`), checked
    against the model key for key on the meta device, written once per artifact as safetensors that every worker
    maps (under ZeRO-3 each module copies its own tensors); (path, where each part came from)."""
    import torch
    from safetensors.torch import save_file

    from deberta.hf import state_mismatch

    init, generator = inputs["init"], inputs.get("generator_init")
    target = scratch / INIT_WEIGHTS_FILE
    try:
        weights, notes = objective.initial_weights(model, init.path, generator.path if generator else "")
    except (ValueError, FileNotFoundError) as e:
        raise StageInputError(f"pretrain.init={init.source}: {e}") from None
    factory, _ = objective.build_model(model)
    with torch.device("meta"):
        want = factory().state_dict()
    _, extra, shapes = state_mismatch(weights, want)  # missing keys keep the fresh init
    bad = extra + shapes
    if bad:
        raise StageInputError(f"pretrain.init={init.source}: {len(bad)} tensors do not fit the model, e.g. {bad[:3]}")
    if not target.is_file():  # written whole, then renamed: present means complete
        seen: set[int] = set()
        tensors = {}
        for key, tensor in weights.items():  # safetensors stores no shared memory: copy repeats (derived parts)
            tensors[key] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
            seen.add(tensor.data_ptr())
        scratch.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target.with_suffix(".tmp")))
        target.with_suffix(".tmp").replace(target)
    return str(target), notes


def init_tags(inputs: dict, notes: dict[str, str]) -> dict[str, str]:
    """Lineage of a continued run (stage run and registry version): the checkpoints it started from, their
    digests, and where each part of the model came from."""
    tags = {}
    for key in ("init", "generator_init"):
        if key in inputs:
            tags.update({f"{key}.source": inputs[key].source, f"{key}.digest": inputs[key].id})
    return {**tags, **{f"init.{part}": note for part, note in notes.items()}}


class SafetensorsFile(Mapping):
    """The tensors of a safetensors file, each read when asked for: a rank building under ZeRO-3 holds one module's
    starting weights at a time, not the model's (safetensors' `safe_open`)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._file = safe_open(path, framework="pt", device="cpu")
        self._keys = tuple(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
