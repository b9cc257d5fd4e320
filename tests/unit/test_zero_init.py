"""ZeRO-3 construction (`training.engine.construct` inside `deepspeed.zero.Init`): on 2 CPU gloo ranks a
rank that builds a model of >= 300M parameters never holds the whole model, and the engine `build` makes around it
(`training.engine.deepspeed_engine`) computes a freshly initialised model's loss. That a model built this way trains
is shown at the smallest size that shows it: AdamW steps equal to plain torch's (tests/unit/test_rtd.py,
test_albert.py and test_checkpointing.py, ZeRO-3 on 2 gloo ranks), the stage's 60 steps and restarts, and that its
ZeRO-3 checkpoint consolidates into the full model
(tests/integration/test_pretrain.py::test_zero3_survives_worker_loss_and_stage_restart); a backward and a step of
the 300M model here would add a third of this test's time and show nothing those do not."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import pytest
import torch

from deberta.config import DebertaConfig
from deberta.model import DebertaForMaskedLM, init_weights

MODEL = DebertaConfig(vocab_size=8000, hidden_size=1536, num_hidden_layers=10, num_attention_heads=24,
                      intermediate_size=6144, position_buckets=256, share_att_key=True, conv_kernel_size=3,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
"""The 1.5B's layer (1536 wide, 24 heads, 256 log buckets, shared position projections, conv), 10 of them, and an
8,000-row vocabulary: 307M parameters, 1.14 GiB in fp32, whose largest module (the FFN's 1536 x 6144) is 3% of it.
With the paper's 128,100 rows the word embedding would be 38% of such a model and, gathered, set the peak (see
`construct`); 10 layers keep the test at about a minute on 2 cores."""

LEAN = {"reduce_bucket_size": 10**7, "stage3_prefetch_bucket_size": 10**7, "sub_group_size": 10**7,
        "stage3_max_live_parameters": 10**7, "stage3_max_reuse_distance": 10**7}
"""DeepSpeed's buffers at test size (its defaults, sized for GPUs, let a 5e8-element gradient bucket hold a whole
300M model's gradients and AdamW step the whole shard at once): each rank then peaks near 3.7 GiB, its shards, their
fp32 copy, gradients and Adam's two moments."""

LR = 1e-3
WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_zero_init import zero_init_run
    zero_init_run(os.environ["OUT"])
    sys.stdout.flush()
    os._exit(0)  # skip teardown: gloo's threads can abort it ("terminate called without an active exception")
""")


def _trim_heap() -> None:
    """Hand freed heap pages back between the training phases: keeps the test's footprint down on a shared machine
    (DeepSpeed's gathers in the forward pass leave ~0.8 GiB of free heap per rank); not part of what is measured."""
    from training.engine import heap_trimmer

    heap_trimmer()()


def _forward(engine, rank: int) -> dict[str, float]:
    """One MLM forward on a 16-token row (targets every 4th token) that differs per rank: its loss, and what the
    fresh model's logits at the targets look like (in float64)."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, MODEL.vocab_size, (1, 16), generator=g)  # (B, T)
    labels = torch.full_like(ids, -100)
    labels[:, 1::4] = ids[:, 1::4]
    with torch.no_grad():
        out = engine(ids, torch.ones_like(ids), labels)
    z = out["logits"].double()  # (M, V) at the targets, row-major
    at_target = z.gather(1, labels[labels != -100].view(-1, 1)).view(-1)  # (M,)
    lse = torch.logsumexp(z, -1)  # (M,)
    return {"loss": float(out["loss"]), "targets": z.shape[0], "cross_entropy": float((lse - at_target).mean()),
            "logit_std": float(z.std()), "logsumexp": float(lse.mean()), "target_logit": float(at_target.mean())}


def zero_init_run(out: str) -> None:
    """One rank: the model built by `construct` (its peak RSS rise recorded), its engine's forward, gathered values."""
    import deepspeed

    from bench import memory
    from training.deepspeed_config import DeepSpeedConfig
    from training.engine import OptimSpec, construct, deepspeed_engine, init_distributed

    init_distributed("gloo")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ds_config = DeepSpeedConfig(train_batch=world, micro=1, accumulation=1, grad_clip=1.0, zero_stage=3, use_gpu=False,
                                zero_options=LEAN)
    torch.manual_seed(0)
    start = memory.reset_peak()  # the kernel's high-water mark; not ru_maxrss, which holds the parent's size
    model = construct(lambda: DebertaForMaskedLM(MODEL), ds_config, init_module=lambda m: init_weights(m, MODEL))
    rise = memory.peak_bytes() - start
    report = {"rise": rise, "params": sum(p.ds_numel for p in model.parameters()),
              "held": sum(p.ds_tensor.numel() for p in model.parameters())}
    engine = deepspeed_engine(model, OptimSpec(lr=LR, warmup_steps=0, total_steps=10), ds_config)
    _trim_heap()
    report.update(_forward(engine, rank))
    named = dict(model.named_parameters())
    report["shapes"] = {k: list(p.ds_shape) for k, p in named.items()}  # the full shape each shard stands for
    layer = "deberta.encoder.layer.3."
    dense, gain = named[layer + "intermediate.dense.weight"], named[layer + "output.LayerNorm.weight"]
    with deepspeed.zero.GatheredParameters([dense, gain]):
        report.update(dense_std=float(dense.detach().std()), gain_ones=bool((gain.detach() == 1).all()))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _check_fresh_init_loss(report: dict) -> None:
    """The forward's loss is a fresh model's. The tied decoder's entries are N(0, 0.02^2) (initializer_range) and
    the head's LayerNorm leaves a state of norm sqrt(H), so the logits are ~N(0, s0^2), s0 = 0.02 sqrt(1536) = 0.78
    (a plain model: 0.786), and loss = ln V + (logsumexp - ln V) - (mean target logit) = ln(8000) + s0^2 / 2 - (the
    mean of M draws of N(0, s0^2)) = 9.30 +- s0 / sqrt(M). Each term is checked: the loss is the cross-entropy of
    the logits (float64), their spread is the init's (5%; over 4 x 8,000 logits the sampling error is under 1%),
    their log-partition exceeds ln V by s^2 / 2 (the lognormal mean; 10%), and the M = 4 target logits are draws of
    that spread (4 sigma). Weights left at PyTorch's defaults (N(0, 1) embeddings: s = 39) fail the second."""
    s0 = MODEL.initializer_range * math.sqrt(MODEL.hidden_size)
    assert report["loss"] == pytest.approx(report["cross_entropy"], rel=1e-5), report
    assert report["logit_std"] == pytest.approx(s0, rel=0.05), report
    s = report["logit_std"]
    assert report["logsumexp"] - math.log(MODEL.vocab_size) == pytest.approx(s**2 / 2, rel=0.1), report
    assert abs(report["target_logit"]) < 4 * s / math.sqrt(report["targets"]), report


@pytest.mark.slow
def test_zero3_rank_builds_a_300m_model_without_holding_it_whole_and_computes_a_fresh_loss(tmp_path):
    """Each rank's peak RSS rise while `construct` builds the model stays well below the model's fp32 size: its own
    shards are 0.5x, and the build adds one module at a time (measured 0.59-0.63x). Every parameter stands for its
    full shape, initialised on gathered modules (linear weights std 0.02: N(0, 0.02), not nn.Linear's own kaiming
    init, std 0.0147; LayerNorm gains exactly 1), and the engine's forward gives a fresh model's loss."""
    import deepspeed  # noqa: F401  (a promised dependency: missing is an error, not a skip)
    from tests.conftest import run_gloo_ranks

    env = {"TEST_DIR": str(Path(__file__).parent), "OUT": str(tmp_path)}
    run_gloo_ranks(WORKER, tmp_path, env, timeout=600)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    params = reports[0]["params"]
    fp32 = 4 * params
    assert params >= 300_000_000, params
    for r, report in enumerate(reports):
        assert report["held"] <= params // 2 + 10**6, report  # the shards: half the model, each
        assert report["rise"] < 0.7 * fp32, (f"rank {r} grew {report['rise'] / 2**30:.2f} GiB building a "
                                             f"{fp32 / 2**30:.2f} GiB model ({report['rise'] / fp32:.2f}x)")
        _check_fresh_init_loss(report)

    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in DebertaForMaskedLM(MODEL).named_parameters()}
    for report in reports:
        assert report["shapes"] == shapes
        assert report["dense_std"] == pytest.approx(MODEL.initializer_range, abs=5e-4)
        assert report["gain_ones"]
