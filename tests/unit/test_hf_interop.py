"""Parity with HF `transformers` DeBERTa-v2 (random weights, fp32, tiny configs) and conversion both ways."""

from __future__ import annotations

import pytest
import torch

from deberta import hf
from deberta.config import PRESETS, DebertaConfig, debug, num_parameters
from deberta.model import DebertaForMaskedLM, DebertaForSequenceClassification, DebertaModel

tf = pytest.importorskip("transformers")

TOL = 1e-5
CONFIGS = {
    "buckets-shared-conv": debug(),
    "buckets-32-shared-noconv": debug(position_buckets=32, max_relative_positions=64, conv_kernel_size=0),
    "nobuckets-separate": debug(position_buckets=0, share_att_key=False, conv_kernel_size=0),
    "nobuckets-k12-separate-conv": debug(position_buckets=0, max_relative_positions=12, share_att_key=False),
    "no-rel-layernorm-math": debug(norm_rel_ebd=False, attn_impl="math", num_attention_heads=4),
}


def _batch(cfg: DebertaConfig, b: int = 3, t: int = 45):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 30:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, cfg.pad_token_id), mask


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    # HF fills masked scores with the dtype minimum, so padded query rows legitimately differ
    return (a - b)[mask.bool()].abs().max().item()


def _randomise(module: torch.nn.Module) -> None:
    """Non-trivial LayerNorm/bias values too, so a wrongly copied or unused tensor shows up."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_backbone_parity_from_hf(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    theirs = tf.DebertaV2Model(hf.to_hf_config(cfg)).eval()
    _randomise(theirs)
    ours = hf.from_transformers(theirs).eval()
    ids, mask = _batch(cfg)
    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
        b = ours(ids, mask)["last_hidden_state"]
        assert _max_diff(a, b, mask) <= TOL
        # no mask at all (packed batches) takes the mask-free path
        torch.testing.assert_close(ours(ids)["last_hidden_state"], theirs(input_ids=ids).last_hidden_state, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["buckets-shared-conv", "nobuckets-separate"])
def test_backbone_parity_to_hf(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    ours = DebertaModel(cfg).eval()
    _randomise(ours)
    theirs = hf.to_transformers(ours)
    ids, mask = _batch(cfg)
    with torch.no_grad():
        assert _max_diff(theirs(input_ids=ids, attention_mask=mask).last_hidden_state, ours(ids, mask)["last_hidden_state"], mask) <= TOL
    back = hf.from_transformers(theirs)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_mlm_head_parity_and_emd_table_stays_ours():
    cfg = debug()
    torch.manual_seed(0)
    theirs = tf.DebertaV2ForMaskedLM(hf.to_hf_config(cfg)).eval()
    _randomise(theirs)
    ours = hf.from_transformers(theirs).eval()
    assert isinstance(ours, DebertaForMaskedLM)
    ids, mask = _batch(cfg)
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).logits
        # HF has no EMD: its logits are our LM head on the backbone's last layer
        hidden = ours.deberta(ids, mask)["last_hidden_state"]
        got = ours.lm_predictions.lm_head(hidden, ours.deberta.embeddings.word_embeddings.weight)
    assert _max_diff(want, got, mask) <= TOL
    exported = hf.to_transformers(ours)
    assert not any("emd" in k or "position_embeddings" in k for k in exported.state_dict())
    with torch.no_grad():
        assert _max_diff(exported(input_ids=ids, attention_mask=mask).logits, want, mask) <= TOL


@pytest.mark.parametrize("num_labels", [3, 1])
def test_classification_parity(num_labels):
    cfg = debug(share_att_key=False)
    torch.manual_seed(0)
    ours = DebertaForSequenceClassification(cfg, num_labels=num_labels, classifier_dropout=0.15).eval()
    _randomise(ours)
    theirs = hf.to_transformers(ours)
    assert theirs.config.cls_dropout == 0.15 and theirs.num_labels == num_labels
    ids, mask = _batch(cfg)
    labels = torch.tensor([0.5, 1.5, -2.0]) if num_labels == 1 else torch.tensor([2, 0, 1])
    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask, labels=labels)
        b = ours(ids, mask, labels=labels)
    # HF returns regression logits flattened to (B,) when labels are given; ours stay (B, 1)
    torch.testing.assert_close(b["logits"].view_as(a.logits), a.logits, atol=TOL, rtol=0)
    torch.testing.assert_close(b["loss"], a.loss, atol=TOL, rtol=TOL)
    back = hf.from_transformers(theirs)
    assert back.num_labels == num_labels and back.classifier_dropout == 0.15


def test_save_pretrained_loads_with_automodel(tmp_path):
    cfg = debug()
    torch.manual_seed(0)
    ours = DebertaForMaskedLM(cfg).eval()
    _randomise(ours)
    path = hf.save_pretrained(ours, tmp_path / "export")
    backbone = tf.AutoModel.from_pretrained(path).eval()
    mlm = tf.AutoModelForMaskedLM.from_pretrained(path).eval()
    ids, mask = _batch(cfg)
    with torch.no_grad():
        hidden = ours.deberta(ids, mask)["last_hidden_state"]
        assert _max_diff(backbone(input_ids=ids, attention_mask=mask).last_hidden_state, hidden, mask) <= TOL
        logits = ours.lm_predictions.lm_head(hidden, ours.deberta.embeddings.word_embeddings.weight)
        assert _max_diff(mlm(input_ids=ids, attention_mask=mask).logits, logits, mask) <= TOL


def test_unsupported_hf_configs_are_refused():
    bad = hf.to_hf_config(debug())
    bad.position_biased_input = True
    with pytest.raises(ValueError, match="position_biased_input"):
        hf.from_transformers(tf.DebertaV2Model(bad))
    legacy = hf.to_hf_config(debug())
    legacy.legacy = True
    with pytest.raises(ValueError, match="legacy"):
        hf.from_transformers(tf.DebertaV2ForMaskedLM(legacy))


@pytest.mark.parametrize("preset", ["deberta-base", "deberta-large", "deberta-1.5b"])
def test_parameter_counts_equal_hf_on_meta(preset):
    cfg = PRESETS[preset]()
    with torch.device("meta"):
        theirs = tf.DebertaV2Model(hf.to_hf_config(cfg))
    assert num_parameters(cfg) == sum(p.numel() for p in theirs.parameters())
    if preset == "deberta-1.5b":
        assert num_parameters(cfg) == 1_564_549_632
        assert cfg.vocab_size * cfg.hidden_size == 196_761_600
