"""The one training engine: what every training loop steps, plain torch or DeepSpeed ZeRO 0-3.

Pretraining, both fine-tuning trainers and the benchmarks build their model, optimizer and schedule here;
nothing else calls `deepspeed.initialize`. The pieces are the same for every caller:

- AdamW (a client torch optimizer: DeepSpeed's own Adam JIT-compiles for minutes) with one weight-decay rule,
  HF Trainer's: no decay on biases and LayerNorm weights (every parameter with fewer than 2 dimensions).
- One schedule, the reference linear one (HF `get_linear_schedule_with_warmup`): with s the number of optimizer
  steps taken so far (0 for the first), lr_s = peak * s / W for s < W, then peak * (T - s) / (T - W), never < 0.
  It is a client `LambdaLR` in both backends; DeepSpeed steps it at every accumulation boundary.
- Gradient clipping by global norm; bf16 on GPU (DeepSpeed's bf16 optimizer); on CPU fp32, or a bf16 autocast
  forward pass over fp32 weights and gradients (`training.precision` decides which).

`Engine` gives loops one interface (`engine(**batch)`, `backward`, `step`, `lr`, `grad_norm`, `save_weights`)
whichever backend is underneath. Distribution is applied here, from outside the model library.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from training.deepspeed_config import DeepSpeedConfig


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


def make_optimizer(model: nn.Module, spec: OptimSpec, fused: bool = False, cpu_adam: bool = False):
    """AdamW over `param_groups` and its `LambdaLR` schedule. `fused`: one CUDA kernel for the whole update.
    `cpu_adam`: DeepSpeed's vectorised `DeepSpeedCPUAdam` (AdamW mode), for a GPU run whose optimizer states ZeRO
    offloads to the CPU; it JIT-builds a C++ op on first use (measured here: 4.4 min on 2 cores, then cached in
    ~/.cache/torch_extensions), so a CPU run, whose torch AdamW already steps on the CPU, keeps torch's."""
    groups = param_groups(model, spec.weight_decay)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, adamw_mode=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(spec.warmup_steps, spec.total_steps))
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, fused=fused)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(spec.warmup_steps, spec.total_steps))


def _disable_shm_comm_op() -> None:
    """DeepSpeed's CPU shared-memory all-reduce op is JIT-compiled (~80 s) when its comm backend starts.

    It only serves `inference_all_reduce` (training uses the gloo process group) and assumes all ranks
    share one host, so we mark it incompatible; `deepspeed.ops.__compatible_ops__` is the dict DeepSpeed
    itself consults (deepspeed/comm/torch.py `build_shm_op`) and documents as editable.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def name_the_accelerator(use_gpu: bool) -> None:
    """Before DeepSpeed's first import in a process that computes on the CPU (use_gpu=false) and sees no GPU:
    DeepSpeed picks its accelerator at import and, finding no GPU, takes the CPU with a warning that it could not
    detect one; `DS_ACCELERATOR` (unless the user set it) names the CPU instead. Where a GPU is visible DeepSpeed
    finds it, as before."""
    if not use_gpu and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def init_distributed(backend: str) -> None:
    """DeepSpeed's comm layer on the process group the launcher (Ray Train, or env vars) describes."""
    name_the_accelerator(backend == "nccl")
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

    def __init__(self, model: nn.Module, optimizer, scheduler, spec: OptimSpec, ds_engine=None,
                 autocast: torch.dtype | None = None, compile: bool = False):
        self.model, self.optimizer, self.scheduler, self.spec, self.ds = model, optimizer, scheduler, spec, ds_engine
        self.autocast = autocast
        """The dtype the forward pass runs in under `torch.autocast` (bf16 on CPU), or None."""
        self._grad_norm: float | None = None
        self._forward = self.ds if self.ds is not None else self.model
        if compile:
            _compile(self.module)
        self.compiled = compile

    @property
    def module(self) -> nn.Module:
        """The model itself (under DeepSpeed, the wrapped module)."""
        return self.ds.module if self.ds is not None else self.model

    @property
    def device(self) -> torch.device:
        return self.ds.device if self.ds is not None else next(self.model.parameters()).device

    def __call__(self, *args, **kwargs):
        if self.autocast is None:
            return self._forward(*args, **kwargs)
        with torch.autocast(self.device.type, dtype=self.autocast):  # fp32 weights; the loss computed inside
            return self._forward(*args, **kwargs)

    @property
    def precision(self) -> str:
        """What the forward pass computes in, as the run logs it."""
        if self.autocast is not None:
            return f"{str(self.autocast).removeprefix('torch.')} autocast"
        if self.ds is not None and self.ds.bfloat16_enabled():
            return "bf16 (DeepSpeed)"
        return "fp32"

    def __getattr__(self, name: str):
        # model attributes (e.g. `regression`, `embed_for_sift`) reached through the engine, as DeepSpeed does
        if name in ("model", "ds", "_forward"):
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


def heap_trimmer() -> Callable[[], None]:
    """glibc's `malloc_trim(0)`: return the free pages of its heaps to the OS (a no-op where there is no glibc).

    Why: after the first large free, glibc raises its mmap threshold (up to 32 MiB), so later tensors of that size
    come from its heaps, and their pages stay resident after they are freed. Building a ZeRO-3 model frees a
    full-size tensor per parameter (DeepSpeed's gathers and partitioning), so those pages piled up: measured, a
    rank of a 307M-parameter model held 1.12-1.13 GiB after `construct`, of which 0.48-0.51 GiB was free heap.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


@contextlib.contextmanager
def _zero_init(ds_config: DeepSpeedConfig):
    """`deepspeed.zero.Init` that hands freed heap pages back after each module is partitioned, and after each
    module DeepSpeed's `apply` gathered, initialised and re-partitioned (the model's own `self.apply(init)`)."""
    import deepspeed

    trim = heap_trimmer()

    class TrimmingInit(deepspeed.zero.Init):
        def _post_init_method(self, module):
            super()._post_init_method(module)
            trim()

    torch_apply = nn.Module.apply
    try:
        with TrimmingInit(config_dict_or_path=ds_config.to_dict()):
            gathering_apply = nn.Module.apply  # DeepSpeed's, while the context is open

            def apply(module: nn.Module, fn):
                applied = gathering_apply(module, fn)  # recursion reaches every child through this wrapper
                trim()
                return applied

            nn.Module.apply = apply
            yield
    finally:
        nn.Module.apply = torch_apply


def _init_zero3(model: nn.Module, init_module: Callable[[nn.Module], None] | None,
                weights: Mapping[str, torch.Tensor] | None) -> None:
    """Under `zero.Init` the constructor ran on empty shards: initialise (and load) module by module, each one's
    parameters gathered on every rank (rank 0's values kept) and re-partitioned, so memory peaks at the largest
    module."""
    import deepspeed

    trim = heap_trimmer()
    known = set()
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        names = {f"{prefix}.{n}" if prefix else n: t for n, t in [*own, *module.named_buffers(recurse=False)]}
        known |= set(names)
        loaded = [key for key in names if weights is not None and key in weights]
        if not own or (init_module is None and not loaded):
            continue  # nothing to write: no gather
        with deepspeed.zero.GatheredParameters([t for _, t in own], modifier_rank=0):
            if init_module is not None:
                init_module(module)
            with torch.no_grad():
                for key in loaded:
                    names[key].copy_(weights[key])
        trim()
    unexpected = sorted(set(weights or {}) - known)
    if unexpected:
        raise ValueError(f"weights do not fit the model: {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}")


def construct(make_model: Callable[[], nn.Module], ds_config: DeepSpeedConfig,
              init_module: Callable[[nn.Module], None] | None = None,
              weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The model for a DeepSpeed engine: under ZeRO-3 built inside `deepspeed.zero.Init` (each module partitioned
    as soon as it exists) and initialised/loaded module by module; otherwise built whole. Needs the process group.

    What bounds a rank's memory while it builds under ZeRO-3: its own shards (1/world of the model) plus one module
    at a time. A parameter exists in full once when its module's constructor makes it (DeepSpeed partitions it
    right after), and again whenever its module is gathered (the model's own `self.apply(init)`, `init_module`,
    `weights`); over gloo a gather takes twice the module (torch's gloo all-gather allocates its output a second
    time). Freed heap pages go back to the OS after every module (`heap_trimmer`). Under NCCL all of this is GPU
    memory. Measured with `bench/zero_init_memory.py` (2 CPU gloo ranks, fp32), peak RSS rise of each rank: the
    1.5B's layer x 10, V=8,000 (307M parameters, 1.14 GiB): 0.69-0.71 GiB (0.60-0.62x), its shards being 0.5x
    (`tests/unit/test_zero_init.py` holds it under 0.7x); H=2048 x 6, V=8,000 (376M, 1.40 GiB): 0.87 GiB (0.62x);
    large's width x 14 with its 128,100 x 1024 embedding (340M, the embedding 0.49 of 1.27 GiB): 1.65 GiB (1.31x):
    that embedding, gathered over gloo, is the peak; the whole 1.5B MLM (48 layers, 128,100 rows: 1,568M, 5.84 GiB):
    4.42 GiB (0.76x), 3.35 GiB held once built. DeepSpeed's own memory comes later and is not counted here:
    `deepspeed.initialize` adds an fp32 copy of the shards and gradient buffers, the
    first step Adam's moments.
    """
    partitioned = ds_config.partitions_parameters
    with _zero_init(ds_config) if partitioned else contextlib.nullcontext():
        model = make_model()
    if partitioned:
        _init_zero3(model, init_module, weights)
    elif weights is not None:
        _load(model, weights)
    return model


def deepspeed_engine(model: nn.Module, spec: OptimSpec, ds_config: DeepSpeedConfig, fused: bool = False,
                     autocast: torch.dtype | None = None, compile: bool = False) -> Engine:
    """`deepspeed.initialize` around a `construct`ed model and its client AdamW + schedule."""
    import deepspeed

    cpu_adam = ds_config.offload != "none" and ds_config.use_gpu
    optimizer, scheduler = make_optimizer(model, spec, fused=fused and not cpu_adam, cpu_adam=cpu_adam)
    ds_engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                              lr_scheduler=scheduler, config=ds_config.to_dict())
    # it moves and copies the shards into its flat buffers; glibc would keep the pages they leave
    # (measured: 0.3-0.4 GiB of a rank of a 335M-parameter model)
    heap_trimmer()()
    return Engine(model, optimizer, scheduler, spec, ds_engine, autocast=autocast, compile=compile)


def _compile(model: nn.Module) -> None:
    """`torch.compile` the model's encoder layers in place (`deberta.model.compile_layers`), the same under DeepSpeed
    (whose own `engine.compile()` compiles the whole module) as on plain torch: the rest of the MLM step has
    data-dependent shapes, and a whole-model graph broke at each of them and recompiled mid-run as they varied."""
    from deberta.model import compile_layers

    if not compile_layers(model):
        raise ValueError(f"compile: {type(model).__name__} has no DeBERTa encoder to compile")


def _checkpointed(make_model: Callable[[], nn.Module], every: int) -> Callable[[], nn.Module]:
    """`make_model` whose encoders recompute every `every`-th layer in the backward pass."""
    from deberta.model import set_activation_checkpointing

    def make() -> nn.Module:
        model = make_model()
        if not set_activation_checkpointing(model, every):
            raise ValueError(f"activation checkpointing: {type(model).__name__} has no DeBERTa encoder to checkpoint")
        return model
    return make


def build(make_model: Callable[[], nn.Module], spec: OptimSpec, *, ds_config: DeepSpeedConfig | None = None,
          backend: str = "gloo", device: torch.device | str = "cpu", seed: int | None = None,
          init_module: Callable[[nn.Module], None] | None = None,
          weights: Mapping[str, torch.Tensor] | None = None,
          autocast: torch.dtype | None = None, compile: bool = False, checkpoint_every: int = 0) -> Engine:
    """Build the model (seeded, so every rank starts from the same weights), load `weights` into it (e.g. the
    pretrained backbone of a fine-tuning trial), and wrap it in its engine. `autocast`: the forward pass's dtype
    under `torch.autocast` (`training.precision`); `compile`: `torch.compile` (DeepSpeed's `engine.compile()`);
    `checkpoint_every`: activation checkpointing of every encoder's layers 0, K, 2K, ... (0: none;
    `deberta.model.set_activation_checkpointing`).

    `ds_config` None: a plain torch engine on `device`. Otherwise DeepSpeed on the process group `backend`
    (nccl/gloo) describes (`construct`, then `deepspeed_engine`); under ZeRO-3 the model is built inside
    `deepspeed.zero.Init`, so that no rank materialises the whole model (`construct` says what bounds a rank's
    memory, measured), and `init_module` (the model library's per-module init) runs again on the gathered modules.
    """
    if seed is not None:
        torch.manual_seed(seed)
    if checkpoint_every:
        make_model = _checkpointed(make_model, checkpoint_every)
    fused = torch.device(device).type == "cuda" or backend == "nccl"
    if ds_config is None:
        model = make_model()
        if weights is not None:
            _load(model, weights)
        model = model.to(device)
        optimizer, scheduler = make_optimizer(model, spec, fused=fused)
        return Engine(model, optimizer, scheduler, spec, autocast=autocast, compile=compile)
    init_distributed(backend)
    return deepspeed_engine(construct(make_model, ds_config, init_module, weights), spec, ds_config, fused,
                            autocast=autocast, compile=compile)


def consolidated_state_dict(checkpoint_dir: Path, tag: str, ds_config: DeepSpeedConfig) -> dict[str, torch.Tensor]:
    """fp32 state dict of the DeepSpeed checkpoint `tag` under `checkpoint_dir` (every rank's files in one directory)."""
    if not ds_config.sharded_checkpoint:  # rank 0's module states are the whole model
        module = torch.load(Path(checkpoint_dir) / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        return {k: v.float() for k, v in module.items()}
    name_the_accelerator(ds_config.use_gpu)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per shard
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag))
