"""bench/objectives.py's measurements: DeBERTaV3's Table 1 cosine, the equal-compute plan, the tables of each sharing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import objectives as bench
from deberta.config import debug
from deberta.heads import DebertaForSequenceClassification
from deberta.rtd import RTDPretrainer

CFG = debug(num_hidden_layers=2)


def test_pairwise_cosine_is_the_mean_over_different_pairs():
    table = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    rows = np.array([0, 3, 5, 7, 11])
    x = torch.nn.functional.normalize(table[rows].double(), dim=-1)
    brute = np.mean([float(x[i] @ x[j]) for i in range(len(rows)) for j in range(len(rows)) if i != j])
    assert bench.mean_pairwise_cosine(table, rows) == pytest.approx(brute, abs=1e-12)
    # orthonormal rows: 0, where counting each row with itself would give 1/n
    assert bench.mean_pairwise_cosine(torch.eye(6), np.arange(6)) == pytest.approx(0.0, abs=1e-12)


def test_rtd_steps_spend_the_mlm_budget():
    args = bench.parse_args(["--objectives", "none,mlm,gdes,es,nes", "--steps", "1000", "--batch", "16"])
    runs = {r["objective"]: r for r in bench.plan_runs(args, CFG, 128)}
    mlm = runs["mlm"]["train_flops"]
    assert runs["none"]["steps"] == 0 and runs["mlm"]["steps"] == 1000
    for name in ("gdes", "es", "nes"):
        r = runs[name]
        assert r["flops_per_token"] > runs["mlm"]["flops_per_token"]  # the generator costs extra
        assert r["steps"] < 1000
        assert abs(r["train_flops"] - mlm) <= 0.5 * r["flops_per_token"] * 16 * 128  # within half a step


@pytest.mark.parametrize("sharing", ["gdes", "es", "nes"])
def test_tables_and_fine_tuned_backbone_of_each_sharing(sharing):
    torch.manual_seed(0)
    model = RTDPretrainer(CFG, embedding_sharing=sharing)
    if sharing == "gdes":
        with torch.no_grad():
            model.embedding_delta.fill_(0.01)  # a trained E_delta: E_D must become E_G + E_delta
    state = model.state_dict()
    rows = np.arange(5, 60)
    stats = bench.embedding_stats(sharing, state, rows)
    e_g = state["generator.deberta.embeddings.word_embeddings.weight"]
    weights = {k: torch.from_numpy(v) for k, v in bench.backbone_weights(sharing, state).items()}
    clf = DebertaForSequenceClassification(CFG, 2, 0.0)
    missing, unexpected = clf.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if k.startswith("deberta.")]
    e_d = weights["deberta.embeddings.word_embeddings.weight"]
    if sharing == "es":
        assert stats["row_cos_E_G_E_D"] == pytest.approx(1.0)
        assert stats["pairwise_cos_E_G"] == stats["pairwise_cos_E_D"]
        assert torch.equal(e_d, e_g)
    elif sharing == "gdes":
        assert torch.allclose(e_d, e_g + 0.01)
        assert stats["pairwise_cos_E_delta"] == pytest.approx(1.0)  # every E_delta row is the same vector
        assert stats["pairwise_cos_E_D"] > stats["pairwise_cos_E_G"]  # the shared offset pulls rows together
    else:
        assert abs(stats["row_cos_E_G_E_D"]) < 0.2  # two independent random tables
        assert not torch.equal(e_d, e_g)


def test_sequences_are_read_from_the_arrow_shards_in_corpus_order(tmp_path):
    from core.artifacts import MANIFEST, SUCCESS
    from stages.tokenize import VERSION, ShardWriter, pack, to_table

    art, vocab = tmp_path / "artifacts" / "tokenize" / "tok", tmp_path / "artifacts" / "vocab" / "voc"
    (art / "train").mkdir(parents=True)
    vocab.mkdir(parents=True)
    (vocab / SUCCESS).write_text("")
    docs = [list(range(10 + 9 * d, 19 + 9 * d)) for d in range(6)]
    parts = [pack(docs[2 * k:2 * k + 2], max_seq_len=8, cls_id=1, sep_id=2, pad_id=0)[:2] for k in range(3)]
    for k in (1, 0, 2):  # written out of order: the split is the files in name order
        table = to_table(*parts[k], [f"doc-{k}"] * len(parts[k][1]))
        shard = ShardWriter(art, f"train/part-00000-{k:03d}.arrow", table.schema, 0.0)
        shard.add(table)
        shard.close()
    (art / MANIFEST).write_text(f'{{"created_at": "2024", "version": "{VERSION}", "inputs": {{"vocab": "voc"}}}}')
    assert bench.find_artifacts(tmp_path) is None  # not finished
    (art / SUCCESS).write_text("")
    assert bench.find_artifacts(tmp_path) == (art, vocab)

    ids = bench.load_sequences(art, "train")
    assert ids.dtype == np.uint32
    np.testing.assert_array_equal(ids, np.concatenate([rows for rows, _ in parts]))  # (N, 8)


def test_tokenize_artifacts_of_parquet_shards_are_passed_over(tmp_path):
    from core.artifacts import MANIFEST, SUCCESS

    art = tmp_path / "artifacts" / "tokenize" / "old"
    (art / "train").mkdir(parents=True)
    (art / "train" / "part-00000.parquet").write_bytes(b"")
    (art / MANIFEST).write_text('{"created_at": "2024", "version": "5", "inputs": {"vocab": "voc"}}')
    (art / SUCCESS).write_text("")
    assert bench.find_artifacts(tmp_path) is None  # so `ensure_artifacts` makes a current one
