"""DeBERTaV3 replaced token detection (`deberta.rtd`) on tiny configs: routing, labels, padding, export, training."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deberta import checkpoint
from deberta.config import debug
from deberta.flops import forward_flops_per_token, rtd_train_flops_per_token
from deberta.heads import DebertaForSequenceClassification
from deberta.model import DebertaForMaskedLM, DebertaModel
from deberta.rtd import (RTDPretrainer, discriminator_weights, generator_config, rtd_init_weights,
                         sample_replacements)

CFG = debug(num_hidden_layers=4)  # generator: 2 layers
QUIET = CFG.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MASK_ID = CFG.vocab_size - 1
REPO = Path(__file__).resolve().parents[2]


def _batch(b: int = 3, t: int = 40, seed: int = 0, every: int = 6):
    """(masked ids, attention mask, labels, original ids): targets every `every` tokens, all [MASK]ed;
    rows 1 and 2 padded from 29 and 12."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, MASK_ID, (b, t), generator=g)
    ids[:, 0] = 1  # [CLS]
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 29:] = 0
    mask[2, 12:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    targets = torch.zeros(b, t, dtype=torch.bool)
    targets[:, 2::every] = True
    targets &= mask.bool()
    labels = torch.where(targets, ids, torch.full_like(ids, -100))
    return ids.masked_fill(targets, MASK_ID), mask, labels, ids


def _model(sharing: str = "gdes", cfg=QUIET, **kw) -> RTDPretrainer:
    torch.manual_seed(0)
    return RTDPretrainer(cfg, embedding_sharing=sharing, **kw)


def _seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rtd_imports_torch_only():
    code = ("import sys, deberta.rtd; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'deepspeed', 'mlflow', 'transformers'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_generator_config_is_half_depth_and_refuses_a_deeper_one():
    assert generator_config(CFG).num_hidden_layers == 2
    assert generator_config(debug(num_hidden_layers=3)).num_hidden_layers == 1
    gen = generator_config(CFG, layers=3)
    assert gen.num_hidden_layers == 3 and gen.replace(num_hidden_layers=4) == CFG  # only the depth differs
    with pytest.raises(ValueError, match="deeper than the 4-layer discriminator"):
        generator_config(CFG, layers=5)
    with pytest.raises(ValueError, match="at least 1 layer"):
        generator_config(CFG, layers=0)


def test_bad_arguments_raise_one_clear_error():
    with pytest.raises(ValueError, match="embedding_sharing='shared'"):
        RTDPretrainer(CFG, embedding_sharing="shared")
    with pytest.raises(ValueError, match="rtd_weight"):
        RTDPretrainer(CFG, rtd_weight=float("nan"))
    masked, mask, labels, _ = _batch()
    with pytest.raises(ValueError, match="labels are required"):
        _model()(masked, mask)


def _grads(model: RTDPretrainer, loss_name: str) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    masked, mask, labels, _ = _batch()
    model(masked, mask, labels, generator=_seeded())[loss_name].backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def _is_zero(g: torch.Tensor | None) -> bool:
    return g is None or not bool(g.any())


E_G = "generator.deberta.embeddings.word_embeddings.weight"
E_D = "discriminator.deberta.embeddings.word_embeddings.weight"  # E_delta under GDES


@pytest.mark.parametrize("sharing", ["gdes", "es", "nes"])
def test_gradient_routing(sharing):
    model = _model(sharing)
    rtd = _grads(model, "rtd_loss")
    mlm = _grads(model, "mlm_loss")
    if sharing == "es":
        assert model.generator_embeddings.weight is model.discriminator.deberta.embeddings.word_embeddings.weight
        assert not _is_zero(rtd[E_G]) and not _is_zero(mlm[E_G])  # one table, both losses
    else:
        assert rtd[E_G] is None and not _is_zero(rtd[E_D])  # L_RTD: E_delta (or E_D) only, E_G exactly untouched
        assert mlm[E_D] is None and not _is_zero(mlm[E_G])  # L_MLM: E_G only
    # the draws carry no gradient: L_RTD never reaches the generator, L_MLM never the discriminator
    for name in rtd:
        if name.startswith("generator.") and name != E_G:
            assert rtd[name] is None, name
        if name.startswith("discriminator.") and name != E_D:
            assert mlm[name] is None, name
    assert not _is_zero(rtd["discriminator.mask_predictions.classifier.weight"])


def test_gdes_full_loss_gives_e_g_exactly_the_mlm_gradient():
    model = _model("gdes")
    full = _grads(model, "loss")
    mlm = _grads(model, "mlm_loss")
    rtd = _grads(model, "rtd_loss")
    assert torch.equal(full[E_G], mlm[E_G])
    assert torch.allclose(full[E_D], model.rtd_weight * rtd[E_D], rtol=1e-5, atol=1e-6)
    assert model.embedding_delta is model.discriminator.deberta.embeddings.word_embeddings.weight
    assert not model.embedding_delta.any()  # E_delta starts at zero: the discriminator starts on E_G


def test_rtd_labels_are_exactly_sampled_differs_from_original():
    model = _model("gdes").eval()
    # a huge LM-head bias on token 7 makes every draw 7: targets whose original is 7 are "sampled == original"
    with torch.no_grad():
        model.generator.lm_predictions.lm_head.bias[7] = 1e4
    masked, mask, labels, ids = _batch(every=4)
    targets = labels != -100
    hit = targets.clone()
    hit[:, 2::8] = False  # half the targets: keep the random original
    ids = torch.where(targets & hit, torch.full_like(ids, 7), ids)
    labels = torch.where(targets, ids, labels)
    out = model(masked, mask, labels)
    disc = out["discriminator_input_ids"]
    assert torch.equal(disc[~targets], ids[~targets])  # the original sequence outside the targets
    assert bool((disc[targets] == 7).all())  # the draws, in place
    assert torch.equal(out["rtd_labels"], targets & (ids != 7))
    assert int(out["num_replaced"]) == int((targets & (ids != 7)).sum()) < int(out["num_targets"])
    assert float(out["replaced_fraction"]) == pytest.approx(float((ids[targets] != 7).float().mean()))


def test_rtd_labels_follow_the_draws_of_a_near_uniform_generator():
    model = _model("nes")
    masked, mask, labels, ids = _batch()
    out = model(masked, mask, labels, generator=_seeded())
    targets = labels != -100
    disc = out["discriminator_input_ids"]
    assert torch.equal(out["rtd_labels"], disc != ids)
    assert not out["rtd_labels"][~targets].any()
    assert float(out["replaced_fraction"]) > 0.9  # a fresh generator rarely draws the original of 1000 tokens


def test_draws_are_reproducible_from_a_generator_or_a_seed():
    model = _model("gdes")
    masked, mask, labels, _ = _batch()
    draw = lambda gen: model(masked, mask, labels, generator=gen)["discriminator_input_ids"]  # noqa: E731
    assert torch.equal(draw(_seeded(3)), draw(_seeded(3)))
    assert torch.equal(draw(3), draw(_seeded(3)))  # an int seeds a generator on the model's device
    assert not torch.equal(draw(_seeded(3)), draw(_seeded(4)))
    torch.manual_seed(11)  # no generator: the default RNG, which the pretraining loop reseeds per step
    a = draw(None)
    torch.manual_seed(11)
    assert torch.equal(a, draw(None))


def test_a_generator_on_another_device_is_one_clear_error():
    logits = torch.zeros(2, 5, device="meta")  # stands in for CUDA logits with a CPU generator
    with pytest.raises(ValueError, match=r"torch.Generator is on cpu but the model runs on meta"):
        sample_replacements(logits, torch.Generator())


def test_padding_contributes_nothing_to_either_loss():
    model = _model("gdes").eval()
    masked, mask, labels, _ = _batch()
    base = model(masked, mask, labels, generator=_seeded())
    # garbage under the padding: other token ids and even labels there must change nothing
    pad = mask == 0
    noisy_ids = masked.masked_fill(pad, 17)
    noisy_labels = labels.masked_fill(pad, 42)
    noisy = model(noisy_ids, mask, noisy_labels, generator=_seeded())
    for key in ("loss", "mlm_loss", "rtd_loss", "num_targets", "num_tokens", "rtd_correct"):
        assert torch.allclose(base[key].float(), noisy[key].float(), atol=1e-6), key
    assert int(base["num_tokens"]) == int(mask.sum())
    # row 2 alone, cut at its length, gives the same losses as inside the padded batch
    n = int(mask[2].sum())
    alone = model(masked[2:, :n], mask[2:, :n], labels[2:, :n], generator=_seeded())
    in_batch = model(masked[2:], mask[2:], labels[2:], generator=_seeded())
    assert torch.equal(alone["discriminator_input_ids"], in_batch["discriminator_input_ids"][:, :n])
    for key in ("mlm_loss", "rtd_loss"):
        assert torch.allclose(alone[key], in_batch[key], atol=1e-5), key


@pytest.mark.parametrize("sharing", ["gdes", "es", "nes"])
def test_discriminator_state_dict_reproduces_the_discriminator(sharing, tmp_path):
    model = _model(sharing).eval()
    table = model.discriminator.deberta.embeddings.word_embeddings.weight
    with torch.no_grad():  # a non-zero E_delta, so the GDES merge is really tested
        table.add_(0.05 * torch.randn(CFG.vocab_size, CFG.hidden_size))
        table[0].zero_()
    masked, mask, labels, _ = _batch()
    disc_ids = model(masked, mask, labels, generator=_seeded())["discriminator_input_ids"]
    with torch.no_grad():
        want = model.discriminator(disc_ids, mask, word_base=model._word_base(disc_ids))["last_hidden_state"]
        backbone = DebertaModel(QUIET).eval()
        backbone.load_state_dict(model.discriminator_state_dict(), strict=True)
        got = backbone(disc_ids, mask)["last_hidden_state"]
    keep = mask.bool()
    assert torch.allclose(got[keep], want[keep], atol=1e-6)
    if sharing == "gdes":
        merged = model.discriminator_state_dict()["embeddings.word_embeddings.weight"]
        assert torch.equal(merged, model.generator_embeddings.weight + model.embedding_delta)
    # with the head: the deberta.* + mask_predictions.* layout that deberta.checkpoint saves and loads
    checkpoint.save(model.discriminator_state_dict(with_head=True), QUIET, tmp_path)
    clf = DebertaForSequenceClassification(QUIET, num_labels=2, classifier_dropout=0.0).eval()
    checkpoint.load_into(clf, tmp_path)
    assert torch.allclose(clf.deberta(disc_ids, mask)["last_hidden_state"][keep], want[keep], atol=1e-6)


def test_generator_state_dict_loads_into_a_masked_lm():
    model = _model("es").eval()
    masked, mask, labels, _ = _batch()
    gen = DebertaForMaskedLM(model.generator_cfg).eval()
    gen.load_state_dict(model.generator_state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(gen(masked, mask, labels)["logits"], model.generator(masked, mask, labels)["logits"])
    with pytest.raises(ValueError, match="not an RTDPretrainer state dict"):
        discriminator_weights(gen.state_dict(), "gdes")


def _progression(b: int = 8, t: int = 32, seed: int = 0):
    """Rows counting up from a random start: a pattern the generator can learn and a replacement breaks."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 200, (b, 1), generator=g)
    ids = 5 + (start + torch.arange(t)) % 200  # (B, T)
    ids[:, 0] = 1
    targets = torch.rand(b, t, generator=g) < 0.15
    targets[:, 0] = False
    labels = torch.where(targets, ids, torch.full_like(ids, -100))
    return ids.masked_fill(targets, MASK_ID), torch.ones_like(ids), labels


def test_loss_falls_over_30_adamw_steps():
    model = _model("gdes", cfg=CFG).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    masked, mask, labels = _progression()
    history = []
    for step in range(30):
        out = model(masked, mask, labels, generator=step)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append((out["loss"].item(), out["mlm_loss"].item(), out["rtd_loss"].item()))
    first, last = history[0], [sum(h[i] for h in history[-3:]) / 3 for i in range(3)]
    assert last[0] < 0.6 * first[0], history
    assert last[1] < first[1] and last[2] < first[2], history
    assert bool(model.embedding_delta.any())  # L_RTD moved E_delta away from zero


def test_rtd_flops_count_generator_and_discriminator():
    cfg = debug(num_hidden_layers=4).replace(vocab_size=128_100)
    gen = generator_config(cfg)
    h, t = cfg.hidden_size, 128
    head = 2 * h * h + 2 * h
    want = 3 * (forward_flops_per_token(gen, t, "mlm", 0.15) + forward_flops_per_token(cfg, t, "backbone") + head)
    assert rtd_train_flops_per_token(cfg, t) == pytest.approx(want)
    assert rtd_train_flops_per_token(cfg, t, generator=cfg) > rtd_train_flops_per_token(cfg, t)


ZERO3_WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_rtd import zero3_run
    zero3_run(os.environ["SHARING"], os.environ["OUT"])
    sys.stdout.flush()
    os._exit(0)  # skip teardown: gloo's threads can abort it ("terminate called without an active exception")
""")


def _train(model, opt, engine=None, steps: int = 3) -> list[float]:
    """`steps` AdamW steps on one fixed batch (every rank the same batch: the averaged gradient is the
    single-process one), each step's draws seeded by its index; clipping at 1.0 either way."""
    masked, mask, labels = _progression()
    losses = []
    for step in range(steps):
        out = (engine or model)(input_ids=masked, attention_mask=mask, labels=labels, generator=step)
        losses.append(out["loss"].item())
        if engine is not None:
            engine.backward(out["loss"])
            engine.step()
        else:
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


def zero3_run(sharing: str, out: str) -> None:
    """One rank, the model built by `training.engine.construct` under ZeRO-3: inside zero.Init (every tensor
    partitioned from the start), then `rtd_init_weights` per module on gathered parameters. Saves the initial and
    trained weights (gathered) and the losses."""
    import deepspeed

    from training.deepspeed_config import DeepSpeedConfig
    from training.engine import construct, init_distributed

    init_distributed("gloo")
    ds_config = DeepSpeedConfig(train_batch=8 * int(os.environ["WORLD_SIZE"]), micro=8, accumulation=1, grad_clip=1.0,
                                zero_stage=3, use_gpu=False,
                                # threshold 0: even these tiny tensors are partitioned and gathered per module (the
                                # default 1e5 would keep every debug-sized tensor whole and test nothing)
                                zero_options={"stage3_param_persistence_threshold": 0})
    torch.manual_seed(0)
    model = construct(lambda: RTDPretrainer(QUIET, embedding_sharing=sharing), ds_config,
                      init_module=lambda module: rtd_init_weights(module, QUIET))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config.to_dict())
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())  # all partitioned
    engine.save_16bit_model(out, "init.pt")  # collective: every rank gathers, rank 0 writes
    losses = _train(model, opt, engine)
    engine.save_16bit_model(out, "final.pt")
    if int(os.environ["RANK"]) == 0:
        torch.save(losses, Path(out) / "losses.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["gdes", "es"])
def test_zero3_engine_matches_plain_torch(sharing, tmp_path):
    """Two gloo ranks, ZeRO-3 built as `training.engine.build` does (zero.Init, re-init per module): E_delta starts
    at zero, and three steps give plain torch's losses and merged discriminator from the same initial weights."""
    import deepspeed  # noqa: F401  (a promised dependency: missing is an error, not a skip)
    from tests.conftest import run_gloo_ranks

    run_gloo_ranks(ZERO3_WORKER, tmp_path, {"TEST_DIR": str(Path(__file__).parent), "SHARING": sharing,
                                             "OUT": str(tmp_path)})
    init = torch.load(tmp_path / "init.pt", weights_only=True)
    if sharing == "gdes":
        assert not init[E_D].any() and init[E_G].any()  # zero.Init + re-init kept E_delta at zero
    plain = RTDPretrainer(QUIET, embedding_sharing=sharing)
    missing, unexpected = plain.load_state_dict(init, strict=False)
    assert not unexpected and set(missing) <= {E_D}, (missing, unexpected)  # a tied alias may be saved once
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    assert torch.load(tmp_path / "losses.pt") == pytest.approx(_train(plain, opt), rel=1e-5)
    got = discriminator_weights(torch.load(tmp_path / "final.pt", weights_only=True), sharing)
    for key, value in plain.discriminator_state_dict().items():
        assert torch.allclose(got[key].float(), value, atol=1e-5), key


# ----------------------------------------------------------------------------------------------- the objective

def test_generator_deeper_than_the_discriminator_is_refused_before_any_stage():
    """The RTD objective's own check (`stages.pretrain.objectives.check_config`), run by `pipeline.run` beside
    `validate`."""
    import argparse

    from core.config import ConfigError, apply_overrides, validate
    from pipeline.presets import PRESETS
    from pipeline.run import UserError, resolve_config
    from stages.pretrain import check_config

    cfg = apply_overrides(PRESETS["debug"](), ["pretrain.objective=rtd", "pretrain.generator_layers=4"])
    validate(cfg)  # the section and cross-section checks pass; the objective's check is its own
    with pytest.raises(ConfigError, match="generator_layers=4 is deeper than the discriminator"):
        check_config(cfg.pretrain, cfg.model)
    args = argparse.Namespace(preset="debug", overrides=["pretrain.objective=rtd", "pretrain.generator_layers=4"],
                              task=None, pretrained=None, corpus=None)
    with pytest.raises(UserError, match="generator_layers=4 is deeper than the discriminator"):
        resolve_config(args)
    check_config(dataclasses.replace(cfg.pretrain, objective="mlm"), cfg.model)  # MLM has no generator


def test_every_objective_is_found_by_its_own_name():
    """`pretrain.objective` names an implementation by the name it gives itself; any other name is refused."""
    from core.config import ConfigError, PretrainConfig
    from stages.pretrain.objectives import OBJECTIVES, objective_for

    assert set(OBJECTIVES) == {"mlm", "rtd"}
    assert all(OBJECTIVES[name].name == name and objective_for(PretrainConfig(objective=name)).name == name
               for name in OBJECTIVES)
    with pytest.raises(ConfigError, match="pretrain.objective='electra': use mlm or rtd"):
        objective_for(PretrainConfig(objective="electra"))


def test_validation_sums_are_named_and_add_up_over_batches():
    """RTD with SOP on top: every total has a name, two batches' totals add, and the metrics are the ratios the
    loop logs (L = L_MLM + lambda L_RTD + L_SOP)."""
    from core.config import PretrainConfig
    from stages.pretrain import objective_for

    objective = objective_for(PretrainConfig(objective="rtd", sop=True, rtd_weight=10.0))
    outputs = {k: torch.tensor(v) for k, v in dict(
        num_targets=4, mlm_loss=2.0, generator_correct=1, num_tokens=10, rtd_loss=0.5, rtd_correct=8, num_replaced=3,
        sop_count=2, sop_loss=0.75, sop_correct=1).items()}
    sums = objective.eval_sums(outputs)
    assert set(sums) == {"mlm_loss_sum", "targets", "correct", "rtd_loss_sum", "tokens", "rtd_correct", "replaced",
                         "sop_loss_sum", "sop_pairs", "sop_correct"}
    metrics = objective.eval_metrics({k: 2 * v for k, v in sums.items()})
    expected = {"val_loss": 2.0 + 10 * 0.5 + 0.75, "val_accuracy": 0.25, "val_targets": 8.0, "val_mlm_loss": 2.0,
                "val_rtd_loss": 0.5, "val_rtd_accuracy": 0.8, "val_all_original_accuracy": 0.7,
                "val_replaced_fraction": 0.75, "val_sop_loss": 0.75, "val_sop_accuracy": 0.5, "val_sop_pairs": 4.0}
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert set(metrics) == {*expected, "val_perplexity"}
