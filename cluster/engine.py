"""The one training engine: what every training loop steps, plain torch or DeepSpeed ZeRO 0-3.

Pretraining, both fine-tuning trainers and the benchmarks build their model, optimizer and schedule here;
nothing else calls `deepspeed.initialize`. The pieces are the same for every caller:

- AdamW (a client torch optimizer: DeepSpeed's own Adam JIT-compiles for minutes) with one weight-decay rule,
  HF Trainer's: no decay on biases and LayerNorm weights (every parameter with fewer than 2 dimensions).
- One schedule, the reference linear one (HF `get_linear_schedule_with_warmup`): with s the number of optimizer
  steps taken so far (0 for the first), lr_s = peak * s / W for s < W, then peak * (T - s) / (T - W), never < 0.
  It is a client `LambdaLR` in both backends; DeepSpeed steps it at every accumulation boundary.
- Gradient clipping by global norm; bf16 on GPU (DeepSpeed's bf16 optimizer), fp32 on CPU (gloo).

`Engine` gives loops one interface (`engine(**batch)`, `backward`, `step`, `lr`, `grad_norm`, `save_weights`)
whichever backend is underneath. Distribution is applied here, from outside the model library.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn


@dataclass(frozen=True)
class OptimSpec:
    """AdamW + schedule + clipping of one training run (Table 8 for pretraining, Table 9 for a trial)."""

    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    grad_clip: float = 1.0


def linear_warmup_decay(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier after `s` optimizer steps: s/W during warmup, then linear decay to 0 at `total` (HF's)."""
    def factor(s: int) -> float:
        if s < warmup:
            return s / max(1, warmup)
        return max(0.0, (total - s) / max(1, total - warmup))
    return factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices, and biases + LayerNorm weights (ndim < 2) without decay.
    Under ZeRO-3 a parameter is a flat shard: its true shape is `ds_shape`."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if len(getattr(p, "ds_shape", p.shape)) < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, spec: OptimSpec, fused: bool = False):
    """AdamW over `param_groups` and its `LambdaLR` schedule. `fused`: one CUDA kernel for the whole update."""
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                            fused=fused)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(spec.warmup_steps, spec.total_steps))


def _disable_shm_comm_op() -> None:
    """DeepSpeed's CPU shared-memory all-reduce op is JIT-compiled (~80 s) when its comm backend starts.

    It only serves `inference_all_reduce` (training uses the gloo process group) and assumes all ranks
    share one host, so we mark it incompatible; `deepspeed.ops.__compatible_ops__` is the dict DeepSpeed
    itself consults (deepspeed/comm/torch.py `build_shm_op`) and documents as editable.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(backend: str) -> None:
    """DeepSpeed's comm layer on the process group the launcher (Ray Train, or env vars) describes."""
    import deepspeed

    if backend == "gloo":
        _disable_shm_comm_op()
    deepspeed.init_distributed(dist_backend=backend)


class Engine:
    """A model with its optimizer and schedule, stepped the same way on either backend.

    torch:     plain module; `step()` clips, steps AdamW and the schedule, zeroes the gradients.
    deepspeed: `deepspeed.initialize` around the same client optimizer and schedule; `step()` is the engine's
               (it accumulates and only updates at the boundary).
    """

    def __init__(self, model: nn.Module, optimizer, scheduler, spec: OptimSpec, ds_engine=None):
        self.model, self.optimizer, self.scheduler, self.spec, self.ds = model, optimizer, scheduler, spec, ds_engine
        self._grad_norm: float | None = None

    @property
    def module(self) -> nn.Module:
        """The model itself (under DeepSpeed, the wrapped module)."""
        return self.ds.module if self.ds is not None else self.model

    @property
    def device(self) -> torch.device:
        return self.ds.device if self.ds is not None else next(self.model.parameters()).device

    def __call__(self, *args, **kwargs):
        return (self.ds if self.ds is not None else self.model)(*args, **kwargs)

    def __getattr__(self, name: str):
        # model attributes (e.g. `regression`, `embed_for_sift`) reached through the engine, as DeepSpeed does
        if name in ("model", "ds"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def train(self) -> None:
        (self.ds if self.ds is not None else self.model).train()

    def eval(self) -> None:
        (self.ds if self.ds is not None else self.model).eval()

    def backward(self, loss: torch.Tensor) -> None:
        if self.ds is not None:
            self.ds.backward(loss)
        else:
            loss.backward()

    def step(self) -> None:
        if self.ds is not None:
            self.ds.step()  # clipping, the optimizer and the schedule at the accumulation boundary
            return
        self._grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm before clipping, of the last optimizer step."""
        if self.ds is not None:
            norm = self.ds.get_global_grad_norm()
            return None if norm is None else float(norm)
        return self._grad_norm

    @property
    def accumulation(self) -> int:
        return self.ds.gradient_accumulation_steps() if self.ds is not None else 1

    def save_weights(self, directory: Path, filename: str = "model.pt") -> None:
        """The full state dict into `directory/filename` (collective under ZeRO-3: call on every rank)."""
        if self.ds is not None:
            self.ds.save_16bit_model(str(directory), filename)  # ZeRO-3 gathers; rank 0 writes
        else:
            torch.save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, Path(directory) / filename)


def _load(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` (a subset of the model's state dict, e.g. a pretrained backbone) into the model."""
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    if unexpected:
        raise ValueError(f"weights do not fit the model: {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}")


def _init_zero3(model: nn.Module, init_module: Callable[[nn.Module], None] | None,
                weights: Mapping[str, torch.Tensor] | None) -> None:
    """Under `zero.Init` the constructor ran on empty shards: initialise (and load) module by module, each one's
    parameters gathered on rank 0 and re-partitioned, so memory peaks at the largest module."""
    import deepspeed

    known = set()
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        names = {f"{prefix}.{n}" if prefix else n: t for n, t in [*own, *module.named_buffers(recurse=False)]}
        known |= set(names)
        if not own:
            continue
        with deepspeed.zero.GatheredParameters([t for _, t in own], modifier_rank=0):
            if init_module is not None:
                init_module(module)
            for key, tensor in names.items():
                if weights is not None and key in weights:
                    with torch.no_grad():
                        tensor.copy_(weights[key])
    unexpected = sorted(set(weights or {}) - known)
    if unexpected:
        raise ValueError(f"weights do not fit the model: {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}")


def construct(make_model: Callable[[], nn.Module], ds_config: dict[str, Any],
              init_module: Callable[[nn.Module], None] | None = None,
              weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The model for a DeepSpeed engine: under ZeRO-3 built inside `deepspeed.zero.Init` (each module partitioned
    as soon as it exists) and initialised/loaded module by module; otherwise built whole. Needs the process group."""
    import deepspeed

    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    with deepspeed.zero.Init(config_dict_or_path=ds_config) if zero3 else contextlib.nullcontext():
        model = make_model()
    if zero3:
        _init_zero3(model, init_module, weights)
    elif weights is not None:
        _load(model, weights)
    return model


def build(make_model: Callable[[], nn.Module], spec: OptimSpec, *, ds_config: dict[str, Any] | None = None,
          backend: str = "gloo", device: torch.device | str = "cpu", seed: int | None = None,
          init_module: Callable[[nn.Module], None] | None = None,
          weights: Mapping[str, torch.Tensor] | None = None) -> Engine:
    """Build the model (seeded, so every rank starts from the same weights), load `weights` into it (e.g. the
    pretrained backbone of a fine-tuning trial), and wrap it in its engine.

    `ds_config` None: a plain torch engine on `device`. Otherwise DeepSpeed on the process group `backend`
    (nccl/gloo) describes; under ZeRO-3 the model is built inside `deepspeed.zero.Init` (each module partitioned
    as soon as it is built, so that a 1.5B model need not be materialised whole on every rank), and `init_module`
    (the model library's per-module init) runs again on the gathered modules (`_init_zero3`). Measured on 2 CPU
    (gloo) ranks, a 356M-parameter model still grew each rank's resident memory by 1.9-2.2 GiB (fp32: 1.33 GiB):
    the saving is yet to be shown on CPU; GPUs are where it is meant to matter.
    """
    if seed is not None:
        torch.manual_seed(seed)
    fused = torch.device(device).type == "cuda" or backend == "nccl"
    if ds_config is None:
        model = make_model()
        if weights is not None:
            _load(model, weights)
        model = model.to(device)
        optimizer, scheduler = make_optimizer(model, spec, fused=fused)
        return Engine(model, optimizer, scheduler, spec)
    import deepspeed

    init_distributed(backend)
    model = construct(make_model, ds_config, init_module, weights)
    optimizer, scheduler = make_optimizer(model, spec, fused=fused)
    ds_engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                              lr_scheduler=scheduler, config=ds_config)
    return Engine(model, optimizer, scheduler, spec, ds_engine)
