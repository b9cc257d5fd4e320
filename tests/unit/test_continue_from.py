"""Starting weights from a released checkpoint (`deberta.continue_from`), checked against `transformers` itself: a
model we build from a directory written by plain transformers computes what transformers computes from it."""

from __future__ import annotations

import torch
import pytest

from tests.released import hf_config, released, save_released, spm_model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    spm_model(root)
    return root


def _ids(vocab_rows: int = 600, b: int = 3, t: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_rows, (b, t), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    mask = torch.ones_like(ids)
    mask[0, 30:] = 0  # one padded row
    return ids.masked_fill(mask == 0, 0), mask


def _hf(path, cls):
    import transformers

    return getattr(transformers, cls).from_pretrained(path).eval()


@pytest.mark.parametrize("legacy", [False, True], ids=["lm_predictions", "legacy-cls-predictions"])
def test_mlm_from_either_head_layout_computes_what_transformers_does(root, legacy):
    """DebertaV2ForMaskedLM saved with the current head (`lm_predictions.lm_head.*`) or the legacy one
    (`cls.predictions.*`): our MLM without the EMD gives transformers' logits; with the EMD, the zero table makes its
    first pass the checkpoint's last layer."""
    from transformers import DebertaV2ForMaskedLM

    from deberta import continue_from
    from deberta.model import DebertaForMaskedLM

    cfg = hf_config(700)
    cfg.legacy = legacy
    torch.manual_seed(1)
    with torch.no_grad():  # a head that is not the init's: proves it was loaded
        model = DebertaV2ForMaskedLM(cfg)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = save_released(root / f"legacy-{legacy}", model.eval(), root / "spm.model")
    assert any(k.startswith("cls.predictions" if legacy else "lm_predictions") for k in model.state_dict())
    rel = continue_from.read(path)
    weights, notes = continue_from.mlm_weights(rel, emd=True)
    assert notes["lm_head"] == "loaded" and notes["emd_table"].startswith("zero")
    ours = DebertaForMaskedLM(rel.config).eval()
    missing, unexpected = ours.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    ids, mask = _ids()
    with torch.no_grad():
        want = _hf(path, "DebertaV2ForMaskedLM")(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask, use_emd=False)["logits"]
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


def test_a_checkpoint_without_head_gets_a_new_one(root):
    from deberta import continue_from

    weights, notes = continue_from.mlm_weights(continue_from.read(released(root, "model")), emd=False)
    assert notes["lm_head"].startswith("new") and not any(k.startswith("lm_predictions") for k in weights)
    assert "emd_table" not in notes


@pytest.mark.parametrize("sharing", ["gdes", "es", "nes"])
def test_rtd_from_a_discriminator_and_its_generator(root, sharing):
    """RTD from a DebertaV2Model directory and a 1-layer DebertaV2ForMaskedLM generator: the discriminator computes
    the released model's hidden states and the generator its logits (GDES: E_G + E_delta is the released table)."""
    from deberta import continue_from
    from deberta.rtd import RTDPretrainer

    disc_dir, gen_dir = released(root, "model", layers=2, seed=2), released(root, "mlm", layers=1, seed=3)
    disc = continue_from.read(disc_dir)
    gen_cfg = disc.config.replace(num_hidden_layers=1)
    weights, notes = continue_from.rtd_weights(disc, continue_from.read(gen_dir, gen_cfg), 1, sharing, emd=True)
    model = RTDPretrainer(disc.config, generator_layers=1, embedding_sharing=sharing).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("discriminator.mask_predictions.") for k in missing), missing
    assert notes["rtd_head"].startswith("new") and notes["generator"].startswith("loaded")
    ids, mask = _ids()
    with torch.no_grad():
        hidden = model.discriminator(ids, mask, word_base=model._word_base(ids))["last_hidden_state"]
        gen = model.generator(ids, mask, use_emd=False)["logits"]
        want_hidden = _hf(disc_dir, "DebertaV2Model")(input_ids=ids, attention_mask=mask).last_hidden_state
        want_gen = _hf(gen_dir, "DebertaV2ForMaskedLM")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    if sharing != "es":  # ES has one table, the discriminator's: the generator's own is gone by design
        torch.testing.assert_close(gen[keep], want_gen[keep], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden[keep], want_hidden[keep], atol=1e-4, rtol=1e-4)


def test_a_derived_generator_is_the_lower_layers_and_gdes_starts_at_zero(root):
    from deberta import continue_from

    disc = continue_from.read(released(root, "model", layers=2, seed=2))
    weights, notes = continue_from.rtd_weights(disc, None, 1, "gdes", emd=True)
    assert notes["generator"].startswith("derived") and notes["embeddings"].endswith("= 0")
    assert not any(k.startswith("generator.deberta.encoder.layer.1.") for k in weights)
    torch.testing.assert_close(weights["generator.deberta.encoder.layer.0.output.dense.weight"],
                               disc.backbone["deberta.encoder.layer.0.output.dense.weight"])
    assert not weights["discriminator.deberta.embeddings.word_embeddings.weight"].any()


def test_a_generator_of_another_width_is_refused(root):
    from transformers import DebertaV2ForMaskedLM

    from deberta import continue_from

    disc = continue_from.read(released(root, "model", layers=2))
    wide = save_released(root / "wide", DebertaV2ForMaskedLM(hf_config(700, layers=1, hidden=96)),
                         root / "spm.model")
    with pytest.raises(ValueError, match=r"hidden_size=96 \(discriminator: 64\).*width and vocabulary"):
        continue_from.check_generator(continue_from.read(wide).config, disc.config, wide, disc.source)


ZERO3_WORKER = """
import json, os, sys
import torch
import deepspeed
from core.config import PretrainConfig
from deberta.config import DebertaConfig
from stages.pretrain import objective_for
from stages.pretrain.continued import SafetensorsFile
from stages.pretrain.loop import optim_spec
from training.deepspeed_config import build_deepspeed_config
from training.engine import build

cfg = PretrainConfig(objective="rtd", generator_layers=1, zero_stage=3, num_workers=2, micro_batch_size=1,
                     train_batch_size=2, max_steps=1, warmup_steps=0)
model = DebertaConfig(**json.loads(os.environ["MODEL"]))
factory, init_module = objective_for(cfg).build_model(model)
start = SafetensorsFile(os.environ["WEIGHTS"])
engine = build(factory, optim_spec(cfg), ds_config=build_deepspeed_config(cfg, 2, False), backend="gloo", seed=0,
               init_module=init_module, weights=start)
checked, wrong = 0, []
for name, p in engine.module.named_parameters():
    with deepspeed.zero.GatheredParameters([p]):
        if name in start:
            checked += 1
            if not torch.equal(p.detach().cpu(), start[name]):
                wrong.append(name)
if int(os.environ["RANK"]) == 0:
    print("RESULT " + json.dumps({"checked": checked, "wrong": wrong, "file": len(start)}))
sys.stdout.flush()
os._exit(0)
"""


def test_zero3_builds_the_continued_model_from_the_starting_weights(root, tmp_path):
    """Under ZeRO-3 (2 gloo ranks) every module copies its own tensors from the stage's safetensors file while it is
    built (`stages.pretrain.continued.initial_weights`, `training.engine.construct`): gathered back, each parameter
    the file holds equals it - the discriminator, the given generator, and GDES's E_delta = E_D - E_G."""
    import dataclasses
    import json

    from conftest import run_gloo_ranks
    from core.config import PretrainConfig
    from core.init_checkpoint import resolve_checkpoint
    from stages.pretrain import objective_for
    from stages.pretrain.continued import initial_weights

    disc_dir, gen_dir = released(root, "model", layers=2, seed=2), released(root, "mlm", layers=1, seed=3)
    inputs = {"init": resolve_checkpoint(str(disc_dir), key="pretrain.init"),
              "generator_init": resolve_checkpoint(str(gen_dir), key="pretrain.generator_init")}
    model = inputs["init"].config()
    objective = objective_for(PretrainConfig(objective="rtd", generator_layers=1))
    path, notes = initial_weights(objective, model, inputs, tmp_path / "scratch")
    assert notes["generator"].startswith("loaded")
    logs = run_gloo_ranks(ZERO3_WORKER, tmp_path, {"WEIGHTS": path, "MODEL": json.dumps(dataclasses.asdict(model))})
    result = json.loads(next(ln for ln in logs[0].splitlines() if ln.startswith("RESULT "))[7:])
    assert result["wrong"] == [] and result["checked"] == result["file"], result


def test_the_authors_generator_file_beside_the_discriminator(root, tmp_path):
    """The authors' layout: pytorch_model.generator.bin beside the discriminator, holding the absolute position
    table their EMD reads. Its depth is read from its keys; the RTD objective starts the generator (and its EMD
    table) from it, and the generator computes what transformers computes from the same tensors."""
    import shutil

    from transformers import DebertaV2ForMaskedLM

    from core.config import PretrainConfig
    from deberta import continue_from
    from stages.pretrain import objective_for

    disc_dir = tmp_path / "disc"
    shutil.copytree(released(root, "model", layers=2, seed=2), disc_dir)
    torch.manual_seed(4)
    hf_gen = DebertaV2ForMaskedLM(hf_config(700, layers=1)).eval()
    table = torch.randn(128, 64)
    torch.save({**hf_gen.state_dict(), continue_from.AUTHORS_POSITION_TABLE: table},
               disc_dir / continue_from.AUTHORS_GENERATOR_FILE)
    model = continue_from.read(disc_dir).config
    assert continue_from.generator_bin_layers(disc_dir, model) == 1
    weights, notes = objective_for(PretrainConfig(objective="rtd", generator_layers=1)).initial_weights(
        model, str(disc_dir))
    assert notes["generator"].endswith(continue_from.AUTHORS_GENERATOR_FILE)
    assert notes["generator_emd_table"].startswith(continue_from.AUTHORS_POSITION_TABLE)
    torch.testing.assert_close(weights["generator.emd.position_embeddings.weight"], table)
    from deberta.model import DebertaForMaskedLM

    gen = DebertaForMaskedLM(model.replace(num_hidden_layers=1)).eval()
    gen.load_state_dict({k[len("generator."):]: v for k, v in weights.items() if k.startswith("generator.")})
    ids, mask = _ids()
    with torch.no_grad():
        torch.testing.assert_close(gen(ids, mask, use_emd=False)["logits"][mask.bool()],
                                   hf_gen(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   atol=1e-4, rtol=1e-4)
