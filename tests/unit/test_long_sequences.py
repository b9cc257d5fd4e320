"""Sequences past 512 with DeBERTaV3's log-bucket layout (256 buckets, max_relative_positions 512)."""

import torch

from deberta.attention import relative_index
from deberta.config import DebertaConfig
from deberta.model import DebertaForMaskedLM

V3 = dict(position_buckets=256, max_relative_positions=512, share_att_key=True)


def test_log_buckets_map_far_distances_into_the_table():
    cfg = DebertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=2048, **V3)
    delta = torch.arange(-2047, 2048)
    rows = relative_index(delta, cfg)
    assert cfg.att_span == 256 and rows.min() >= 0 and rows.max() <= 2 * cfg.att_span - 1
    assert bool((rows[1:] >= rows[:-1]).all())  # monotonic in i - j: farther never lands nearer
    near = relative_index(torch.arange(-128, 129), cfg)
    assert torch.equal(near, torch.arange(-128, 129) + 256)  # exact up to 128
    # the log range spreads 128..511 over distinct rows; past max_relative_positions distances share the end rows
    mid = relative_index(torch.arange(129, 512), cfg)
    assert len(mid.unique()) > 100 and int(mid.max()) == 2 * cfg.att_span - 1
    assert int(relative_index(torch.tensor([2047]), cfg)) == 2 * cfg.att_span - 1


def test_forward_backward_at_2048_tokens():
    cfg = DebertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=2048, **V3)
    torch.manual_seed(0)
    model = DebertaForMaskedLM(cfg)
    ids = torch.randint(5, 64, (1, 2048))
    labels = torch.full_like(ids, -100)
    labels[0, ::16] = ids[0, ::16]  # targets near both ends: the EMD's absolute table covers all 2,048 rows
    out = model(ids, labels=labels)
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    assert model.deberta.encoder.rel_embeddings.weight.grad.abs().sum() > 0
    assert model.emd.position_embeddings.weight.grad[2032].abs().sum() > 0


def test_long_presets_take_the_v3_layout_and_keep_tokens_per_step():
    from core.config import validate
    from pipeline.presets import PRESETS

    base = PRESETS["cpu-small"]()
    for length in (1024, 2048):
        cfg = PRESETS[f"cpu-small-{length}"]()
        validate(cfg)
        assert cfg.tokenize.max_seq_len == cfg.model.max_position_embeddings == length
        assert (cfg.model.position_buckets, cfg.model.max_relative) == (256, 512)
        assert cfg.pretrain.train_batch_size * length == base.pretrain.train_batch_size * base.tokenize.max_seq_len
