"""The objectives by name: the one place that reads `pretrain.objective`.

A new objective is one file beside `mlm.py` and `rtd.py` (an `Objective` with its `name`, its checks and its model)
and one entry in `OBJECTIVES`; ALBERT's SOP composes onto any of them (`sop.with_sentence_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.config import ConfigError, PretrainConfig
from stages.pretrain.mlm import MLM
from stages.pretrain.objective import Objective
from stages.pretrain.rtd import RTD
from stages.pretrain.sop import with_sentence_order

if TYPE_CHECKING:
    from deberta.config import DebertaConfig

OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (MLM, RTD)}
"""`pretrain.objective` -> its implementation."""


def objective_for(cfg: PretrainConfig) -> Objective:
    """The objective `cfg` names, with ALBERT's SOP on top when `pretrain.sop` is set."""
    if cfg.objective not in OBJECTIVES:
        raise ConfigError(f"pretrain.objective={cfg.objective!r}: use {' or '.join(OBJECTIVES)}")
    objective = OBJECTIVES[cfg.objective]
    return (with_sentence_order(objective) if cfg.sop else objective)(cfg)


def check_config(cfg: PretrainConfig, model: DebertaConfig) -> None:
    """The objective's own settings, alone and against the [model] section, and the attention backend against the
    devices; run with `validate`, before any stage."""
    objective = objective_for(cfg)
    problems = objective.check(model)
    if cfg.document_mask and not objective.reads_documents:
        problems.append(f"pretrain.document_mask=true: the {objective.title} objective "
                        f"does not read document boundaries; use objective=mlm without sop, or document_mask=false")
    if model.attn_impl == "fused":
        import importlib.util

        if not cfg.use_gpu:
            problems.append("model.attn_impl=fused runs on CUDA GPUs only: set pretrain.use_gpu=true, or "
                            "model.attn_impl=sdpa")
        elif importlib.util.find_spec("disentangled_flash") is None:
            problems.append("model.attn_impl=fused needs the disentangled-flash package (pip install -e '.[fused]'); "
                            "or model.attn_impl=sdpa")
    if problems:
        raise ConfigError("; ".join(problems))
