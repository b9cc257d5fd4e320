"""Continued pretraining from a released checkpoint, through `python -m pipeline.run` against a real `mlflow server`:
a directory written by plain `transformers` (tests/released.py) continued on another real corpus (news articles),
for MLM and for RTD (a given generator, a derived one), and a registry version as `pretrain.init`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import continue_steps, run_pipeline

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# The MLM continued from the released checkpoint for 12 steps is the session's `continued_mlm` (tests/conftest.py):
# test_pipeline_cli.py reads the same run for what the entry point registers and for fine-tuning from it.


def released_loss(checkpoint: Path, arts: dict[str, Path]) -> float:
    """The validation MLM loss `transformers` computes for the checkpoint on the stage's step-0 masked batches."""
    import torch
    from transformers import DebertaV2ForMaskedLM

    from core.config import PretrainConfig
    from core.tokenizer import Tokenizer
    from deberta.config import DebertaConfig
    from stages.pretrain import _loop_job, objective_for, token_shards
    from stages.pretrain.loop import EVAL_MASK_OFFSET, validation_batches

    manifest = json.loads((arts["pretrain"] / "manifest.json").read_text())
    cfg, model = PretrainConfig(**manifest["config"]["pretrain"]), DebertaConfig(**manifest["config"]["model"])
    train, _, seq_len = token_shards(type("A", (), {"path": arts["tokenize"]}), "train")
    val, _, _ = token_shards(type("A", (), {"path": arts["tokenize"]}), "validation")
    job = _loop_job(cfg, model, None, seq_len, train, val, Tokenizer.load(arts["vocab"]), None, objective_for(cfg))
    masker, hf = job.masker(), DebertaV2ForMaskedLM.from_pretrained(checkpoint).eval()
    total = count = 0.0
    with torch.no_grad():
        for rank in range(cfg.num_workers):
            for i, batch in enumerate(validation_batches(job, rank, cfg.num_workers)):
                ids = batch["input_ids"]
                masked, labels = masker(ids, step=EVAL_MASK_OFFSET + i * cfg.num_workers + rank)
                n = float((labels != -100).sum())
                total += float(hf(input_ids=masked, attention_mask=(ids != 0).long(), labels=labels).loss) * n
                count += n
    return total / count


def test_mlm_continues_the_released_checkpoint(released_checkpoints, continued_mlm, mlflow_server):
    """Weights, head and tokenizer all taken (the step-0 loss equals transformers' own on the same masked batches),
    the validation loss falls, hf/ loads in transformers, and the registry version traces back to corpus and
    checkpoint."""
    import mlflow
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    checkpoints = released_checkpoints
    res, _, arts, version = continued_mlm
    assert "(the tokenizer of pretrain.init)" in res.stdout and "lm_head loaded" in res.stdout
    vocab = arts["vocab"]
    assert (vocab / "spm.model").read_bytes() == (checkpoints["mlm"] / "spm.model").read_bytes()
    theirs = AutoTokenizer.from_pretrained(checkpoints["mlm"])
    assert json.loads((vocab / "special_tokens.json").read_text()) == {
        t: theirs.convert_tokens_to_ids(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")}
    metrics = json.loads((arts["pretrain"] / "metrics.json").read_text())
    assert metrics["val_loss_released"] == pytest.approx(released_loss(checkpoints["mlm"], arts), abs=1e-4)
    assert metrics["val_loss"] < metrics["initial_val_loss"] - 0.05, metrics
    AutoModelForMaskedLM.from_pretrained(arts["pretrain"] / "hf")
    client = mlflow.MlflowClient(mlflow_server)
    pretrained = client.get_model_version("deberta-debug-pretrained", version).tags
    assert pretrained["init.source"] == str(checkpoints["mlm"]) and pretrained["init.lm_head"] == "loaded"
    assert pretrained["corpus"] == arts["corpus"].name and pretrained["pretrain"] == arts["pretrain"].name


def hf_weights(directory: Path) -> dict[str, "torch.Tensor"]:
    """A transformers directory's tensors by backbone name (the `deberta.` prefix of a model with a head dropped)."""
    from safetensors.torch import load_file

    return {k.removeprefix("deberta."): v for k, v in load_file(directory / "model.safetensors").items()}


def drift(ours: dict, theirs: dict, keys) -> float:
    """The largest entry-wise difference between two state dicts over `keys`."""
    return max(float((ours[k] - theirs[k]).abs().max()) for k in keys)


# RTD from a DebertaV2Model directory and a given generator (`pretrain.generator_init`) is checked on the tensors by
# tests/unit/test_continue_from.py (the discriminator computes the released hidden states, the generator its logits,
# GDES's E_G + E_delta is the released table, and under ZeRO-3); the run below takes the other road, a registry
# version with no generator, through the whole pipeline.

def test_rtd_from_a_registry_version_derives_its_generator(released_checkpoints, continued_mlm, news_subset,
                                                           mlflow_server):
    """RTD continued from `models:/deberta-debug-pretrained/N` for 4 steps: the discriminator starts from the
    version's weights, the generator is derived from them (its one layer the discriminator's first, DeBERTaV3's half
    depth) and GDES starts at E_delta = 0 (E_G = E_D). Read from the artifact's tensors: 4 AdamW steps at lr <= 1e-3
    move an entry by at most ~4e-3, so each starting point is within 0.01 of where it came from, while weights of
    another origin (the released checkpoints' random init, std 0.02) are 0.05 and more away."""
    _, workdir, arts, version = continued_mlm
    uri = f"models:/deberta-debug-pretrained/{version}"
    res = run_pipeline(["--corpus", str(news_subset(300)), "--workdir", str(workdir), "--set", "pretrain.objective=rtd",
                        "--set", f"pretrain.init={uri}", *continue_steps(4), "--until", "pretrain"], mlflow_server)
    ran = {m.group(1): Path(m.group(2)) for m in re.finditer(r"^  (\w+) +\w+  \(ran\)  (\S+)$", res.stdout, re.M)}
    out, start = ran["pretrain"], hf_weights(arts["pretrain"] / "hf")
    disc, gen = hf_weights(out / "hf"), hf_weights(out / "generator")
    layers = {k for k in start if k.startswith("encoder.layer.")}
    assert drift(disc, start, layers) < 0.01, "the discriminator did not start from the registry version"
    first = {k for k in layers if k.startswith("encoder.layer.0.")}
    assert not any(k.startswith("encoder.layer.1.") for k in gen), sorted(gen)[:5]  # one layer of two
    assert drift(gen, start, first) < 0.01, "the generator is not the version's lower layer"
    assert drift(gen, disc, {"embeddings.word_embeddings.weight"}) < 0.01  # E_G = E_D at the start: E_delta = 0
    assert drift(start, hf_weights(released_checkpoints["model"]), layers) > 0.05  # the bound tells origins apart


# ------------------------------------------------------------------------------------------------------ refusals

def _wide_generator(checkpoints, tmp):
    from transformers import DebertaV2ForMaskedLM

    from tests.released import hf_config, save_released

    return ["--set", "pretrain.objective=rtd", "--set", f"pretrain.init={checkpoints['model']}", "--set",
            "pretrain.generator_init=" + str(save_released(tmp / "wide", DebertaV2ForMaskedLM(
                hf_config(700, layers=1, hidden=96)), checkpoints["mlm"] / "spm.model"))]


def _long_tokenizer(checkpoints, tmp):
    import shutil

    shutil.copytree(checkpoints["mlm"], tmp / "short")
    config = json.loads((tmp / "short" / "config.json").read_text())
    (tmp / "short" / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    return ["--set", f"pretrain.init={tmp / 'short'}"]


@pytest.mark.parametrize("make, fragment", [
    (lambda c, tmp: ["--set", f"pretrain.init={tmp}"], "pretrain.init=%s: not a DeBERTa-v2/v3 model"),
    (_long_tokenizer, "the tokenizer has 601 ids but config.vocab_size=300"),
    (_wide_generator, "its hidden_size=96 (discriminator: 64), intermediate_size=384 (discriminator: 256): a generator"),
    (lambda c, tmp: ["--set", "pretrain.init=models:/deberta-debug-pretrained/999"], "pretrain.init=models:/"),
    (lambda c, tmp: ["--set", f"pretrain.init={c['mlm']}", "--set", "model.hidden_size=128"],
     "model.hidden_size=128 (config.json: 64) contradicts pretrain.init="),
    (lambda c, tmp: ["--preset", "deberta-v3-base-continue"], "preset deberta-v3-base-continue continues"),
], ids=["not-deberta", "tokenizer-longer-than-rows", "generator-width", "unknown-version", "shape-override",
        "continue-preset-without-init"])
def test_bad_init_is_one_message_before_ray(make, fragment, released_checkpoints, tmp_path, capsys):
    from pipeline.run import main

    args = make(released_checkpoints, tmp_path)
    capsys.readouterr()  # what making the input printed
    assert main([*args, "--workdir", str(tmp_path / "wd")]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment.replace("%s", str(tmp_path)) in lines[0], err
    assert "plan:" not in out and not (tmp_path / "wd" / "artifacts").exists()
