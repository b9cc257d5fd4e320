"""Behaviour of the model library on tiny configs (no transformers needed here; see test_hf_interop.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from deberta.attention import log_bucket_position, relative_index
from deberta.config import DebertaConfig, debug, padded_vocab_size
from pipeline.presets import MODEL_1_5B, MODEL_BASE, MODEL_LARGE
from deberta.flops import forward_flops_per_token, reachable_rows, train_flops_per_token
from deberta.heads import DebertaForSequenceClassification
from deberta.model import DebertaForMaskedLM, DebertaModel, num_parameters

CONFIGS = {
    "1.5b-like": debug(),
    "no-buckets-separate": debug(position_buckets=0, max_relative_positions=16, share_att_key=False, conv_kernel_size=0),
    "math": debug(attn_impl="math"),
}


def _batch(cfg: DebertaConfig, b: int = 3, t: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 29:] = 0
    mask[2, 7:] = 0
    return ids.masked_fill(mask == 0, cfg.pad_token_id), mask


def _model(cls, cfg, **kw):
    torch.manual_seed(0)
    return cls(cfg, **kw).eval()


def test_bucket_mapping_matches_spec_formula():
    span, max_pos = 256, 512
    deltas = torch.arange(-600, 601)
    got = log_bucket_position(deltas, span, max_pos)
    mid = span // 2
    for d, b in zip(deltas.tolist(), got.tolist()):
        want = d if abs(d) <= mid else int(math.copysign(math.ceil(math.log(abs(d) / mid) / math.log((max_pos - 1) / mid) * (mid - 1)) + mid, d))
        assert b == want, (d, b, want)
    rows = relative_index(deltas, MODEL_1_5B)
    assert rows.min() >= 0 and rows.max() <= 2 * 256 - 1
    assert int(relative_index(torch.tensor([511]), MODEL_1_5B)) == 511  # the last bucket


def _naive_layer_attention(layer, x: torch.Tensor, table: torch.Tensor, cfg: DebertaConfig) -> torch.Tensor:
    """score(i,j) = (Qc_i·Kc_j + Qc_i·Kr[r(i,j)] + Kc_j·Qr[r(i,j)]) / sqrt(3d), written with explicit
    (T, T, d) relative tensors: the definition the efficient form must reproduce."""
    att = layer.attention.self
    t, nh, d = x.shape[1], cfg.num_attention_heads, cfg.head_dim
    q = att.query_proj(x).view(1, t, nh, d)
    k = att.key_proj(x).view(1, t, nh, d)
    v = att.value_proj(x).view(1, t, nh, d)
    kr_proj, qr_proj = (att.key_proj, att.query_proj) if cfg.share_att_key else (att.pos_key_proj, att.pos_query_proj)
    pos = torch.arange(t)
    r = relative_index(pos[:, None] - pos[None, :], cfg)  # (T, T)
    kr = kr_proj(table)[r].view(t, t, nh, d)
    qr = qr_proj(table)[r].view(t, t, nh, d)
    scores = (torch.einsum("ihd,jhd->hij", q[0], k[0]) + torch.einsum("ihd,ijhd->hij", q[0], kr)
              + torch.einsum("jhd,ijhd->hij", k[0], qr)) / math.sqrt(3 * d)
    ctx = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[0]).reshape(1, t, nh * d)
    return layer.attention.output(ctx, x)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_efficient_attention_equals_definition(name):
    cfg = CONFIGS[name]
    model = _model(DebertaModel, cfg)
    x = torch.randn(1, 37, cfg.hidden_size)
    layer = model.encoder.layer[0]
    rel = model.encoder.relative_context(37)
    with torch.no_grad():
        got = layer.attention.output(layer.attention.self(x, None, rel), x)
        want = _naive_layer_attention(layer, x, rel.table, cfg)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padding_does_not_change_real_positions(name):
    cfg = CONFIGS[name]
    model = _model(DebertaModel, cfg)
    ids, mask = _batch(cfg)
    with torch.no_grad():
        padded = model(ids, mask)["last_hidden_state"]
        for row, n in ((1, 29), (2, 7)):
            alone = model(ids[row : row + 1, :n])["last_hidden_state"]
            torch.testing.assert_close(padded[row, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_sdpa_and_math_agree_in_training_without_dropout():
    cfg = debug(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, mask = _batch(cfg)
    grads = []
    for impl in ("sdpa", "math"):
        model = _model(DebertaModel, cfg.replace(attn_impl=impl)).train()
        out = model(ids, mask)["last_hidden_state"]
        (out * mask[..., None]).square().sum().backward()
        grads.append((out.detach(), model.encoder.rel_embeddings.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-4, rtol=1e-4)


def test_pad_row_gets_no_gradient_and_checkpointing_matches():
    cfg = debug(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, mask = _batch(cfg)
    results = []
    for ckpt in (False, True):
        model = _model(DebertaModel, cfg).train()
        model.encoder.gradient_checkpointing = ckpt
        model(ids, mask)["last_hidden_state"].sum().backward()
        grad = model.embeddings.word_embeddings.weight.grad
        assert grad[cfg.pad_token_id].abs().max() == 0
        results.append(grad.clone())
    torch.testing.assert_close(results[0], results[1])


def _targets(cfg, ids, mask, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & (mask == 1), ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]  # at least one target at position 0
    return labels


@pytest.mark.parametrize("name", list(CONFIGS))
def test_emd_masked_only_equals_full(name):
    cfg = CONFIGS[name]
    model = _model(DebertaForMaskedLM, cfg)
    ids, mask = _batch(cfg)
    labels = _targets(cfg, ids, mask)
    with torch.no_grad():
        out = model(ids, mask, labels)
        full = model(ids, mask)["logits"]  # (B, T, V), queries everywhere
    targets = labels != -100
    torch.testing.assert_close(out["logits"], full[targets], atol=1e-5, rtol=1e-5)
    assert out["num_targets"] == targets.sum()
    torch.testing.assert_close(out["loss"], F.cross_entropy(full[targets], labels[targets]), atol=1e-5, rtol=1e-5)
    assert out["correct"] == (full[targets].argmax(-1) == labels[targets]).sum()


def test_emd_is_two_passes_of_last_layer_with_absolute_positions():
    """Rebuild the EMD from the generic layer forward: H = layer L-1 output, query = H + P, twice."""
    cfg = debug()
    model = _model(DebertaForMaskedLM, cfg)
    ids, mask = _batch(cfg)
    with torch.no_grad():
        hidden, kmask, rel = model.deberta.encode(ids, mask, num_layers=cfg.num_hidden_layers - 1)
        last = model.deberta.encoder.layer[-1]
        query = hidden + model.emd.position_embeddings.weight[: ids.shape[1]]
        for _ in range(2):
            query = last(hidden, kmask, rel, query_states=query)
        want = model.lm_predictions.lm_head(query, model.deberta.embeddings.word_embeddings.weight)
        got = model(ids, mask)["logits"]
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        # absolute positions matter: a different table changes the predictions
        model.emd.position_embeddings.weight.normal_()
        assert not torch.allclose(model(ids, mask)["logits"][real], got[real], atol=1e-3)


def test_mlm_without_targets_and_backward():
    cfg = debug()
    model = _model(DebertaForMaskedLM, cfg).train()
    ids, mask = _batch(cfg)
    out = model(ids, mask, torch.full_like(ids, -100))
    assert out["logits"].shape == (0, cfg.vocab_size) and float(out["loss"].detach()) == 0.0
    out = model(ids, mask, _targets(cfg, ids, mask))
    out["loss"].backward()
    assert model.emd.position_embeddings.weight.grad.abs().sum() > 0
    assert model.deberta.encoder.layer[-1].attention.self.query_proj.weight.grad.abs().sum() > 0


def test_classification_uses_all_layers_no_emd_and_losses():
    cfg = debug()
    ids, mask = _batch(cfg)
    clf = _model(DebertaForSequenceClassification, cfg, num_labels=3, classifier_dropout=0.1)
    assert not any("emd" in n for n, _ in clf.named_parameters())
    backbone = DebertaModel(cfg).eval()
    backbone.load_state_dict(clf.deberta.state_dict())
    with torch.no_grad():
        hidden = backbone(ids, mask)["last_hidden_state"]
        want = clf.classifier(F.gelu(clf.pooler.dense(hidden[:, 0])))
        out = clf(ids, mask, labels=torch.tensor([0, 2, 1]))
    torch.testing.assert_close(out["logits"], want)
    torch.testing.assert_close(out["loss"], F.cross_entropy(want, torch.tensor([0, 2, 1])))
    reg = _model(DebertaForSequenceClassification, cfg, num_labels=1, classifier_dropout=0.0)
    y = torch.tensor([0.5, -1.0, 2.0])
    out = reg(ids, mask, labels=y)
    assert out["logits"].shape == (3, 1)
    torch.testing.assert_close(out["loss"], F.mse_loss(out["logits"].view(-1), y))


def test_config_is_frozen_validated_and_presets():
    cfg = debug()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 10  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_attention_heads"):
        debug(num_attention_heads=3)
    with pytest.raises(ValueError, match="attn_impl"):
        debug(attn_impl="flash")
    assert DebertaConfig.from_dict(cfg.to_dict()) == cfg
    assert padded_vocab_size(128_001) == 128_100 and padded_vocab_size(128_000, 128) == 128_000
    big = MODEL_1_5B
    assert (big.num_hidden_layers, big.hidden_size, big.att_span, big.share_att_key, big.conv_kernel_size) == (48, 1536, 256, True, 3)
    assert MODEL_BASE.att_span == 512 and not MODEL_LARGE.share_att_key


def test_parameter_count_1_5b_on_meta_device():
    cfg = MODEL_1_5B
    assert num_parameters(cfg) == 1_564_549_632
    # the MLM adds the LM head (dense + LayerNorm + bias; decoder tied) and the EMD position table
    h = cfg.hidden_size
    extra = h * h + h + 2 * h + cfg.vocab_size + cfg.max_position_embeddings * h
    assert num_parameters(cfg, "mlm") == 1_564_549_632 + extra


def test_flops_are_6n_plus_attention():
    cfg = MODEL_BASE
    with torch.device("meta"):
        model = DebertaModel(cfg)
    matmul_params = sum(p.numel() for n, p in model.encoder.layer.named_parameters()
                        if n.endswith("weight") and p.dim() == 2 and "pos_" not in n)
    t = 512
    attention = cfg.num_hidden_layers * (4 * t * cfg.hidden_size + 4 * reachable_rows(cfg, t) * cfg.hidden_size)
    assert train_flops_per_token(cfg, t, task="backbone") == pytest.approx(6 * matmul_params + 3 * attention)
    # the MLM's EMD + masked-only head costs less than a full head at every token
    assert forward_flops_per_token(cfg, t, "mlm") < forward_flops_per_token(cfg, t, "mlm_full_head")


def test_library_imports_torch_only():
    """deberta/ must not pull in Ray, DeepSpeed, MLflow, or transformers (only deberta.hf, lazily)."""
    import subprocess
    import sys

    code = ("import sys, deberta, deberta.model, deberta.masking, deberta.sift, deberta.flops, deberta.hf; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'deepspeed', 'mlflow', 'transformers'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_albert_options_off_leave_the_model_as_it_was():
    """embedding_size=0, share_layers="none" (the defaults): the HF-named layout, every layer its own, no new keys."""
    cfg = debug()
    model = DebertaForMaskedLM(cfg)
    state = model.state_dict()
    assert not [k for k in state if "embed_proj" in k or "sop_head" in k]
    assert state["deberta.embeddings.word_embeddings.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert state["lm_predictions.lm_head.dense.weight"].shape == (cfg.hidden_size, cfg.hidden_size)
    enc = model.deberta.encoder
    assert len(enc.layer) == cfg.num_hidden_layers and enc.last_layer is enc.layer[-1]
    assert all(enc.layer_at(i) is enc.layer[i] for i in range(cfg.num_hidden_layers))
    for i in range(cfg.num_hidden_layers):
        assert f"deberta.encoder.layer.{i}.attention.self.query_proj.weight" in state
        assert f"deberta.encoder.layer.{i}.output.dense.weight" in state
    ids, mask = _batch(cfg)
    assert set(model.eval()(ids, mask, _targets(cfg, ids, mask))) == {"loss", "logits", "num_targets", "correct"}
