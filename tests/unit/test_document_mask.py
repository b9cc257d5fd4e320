"""Packed rows without cross-document attention: a document's states in a packed row are its states alone."""

import pytest
import torch

from deberta.config import DebertaConfig
from deberta.model import DebertaForMaskedLM, DebertaModel, document_mask

CFG = DebertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
                    position_buckets=8, max_relative_positions=32, share_att_key=True)
LENGTHS = (5, 9, 2)  # three documents packed into one row of 16


def _packed():
    torch.manual_seed(0)
    ids = torch.randint(5, 64, (1, sum(LENGTHS)))
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(LENGTHS)]).unsqueeze(0)  # (1, 16)
    return ids, docs


@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])  # the CPU backends ("fused": tests/gpu/test_fused.py refuses it)
def test_each_document_in_a_packed_row_equals_the_document_alone(attn_impl):
    model = DebertaModel(CFG.replace(attn_impl=attn_impl)).eval()
    ids, docs = _packed()
    with torch.no_grad():
        packed = model(ids, document_ids=docs)["last_hidden_state"][0]
        unmasked = model(ids)["last_hidden_state"][0]
        start = 0
        for n in LENGTHS:
            alone = model(ids[:, start:start + n])["last_hidden_state"][0]
            torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=0)
            start += n
    # without the mask the documents see each other: the check above can tell the two apart
    assert not torch.allclose(packed, unmasked, atol=1e-3)


def test_mask_with_padding_and_emd_logits():
    """Padding keys stay masked under the document mask, and the EMD's queries get their own rows of it (the first
    document: the EMD adds absolute positions, which a later document's differ from its own alone)."""
    ids, docs = _packed()
    mask = document_mask(docs, torch.tensor([[True] * 14 + [False] * 2]))
    assert mask.shape == (1, 1, 16, 16) and not mask[0, 0, :, 14:].any() and not mask[0, 0, 0, 5]
    model = DebertaForMaskedLM(CFG).eval()
    with torch.no_grad():
        packed = model(ids, document_ids=docs)["logits"][0]
        alone = model(ids[:, :5])["logits"][0]
    torch.testing.assert_close(packed[:5], alone, atol=1e-5, rtol=0)


def test_tokenize_records_each_tokens_document_and_pretraining_reads_it(tmp_path):
    """The doc_index column `stages.tokenize` writes for packed rows: [CLS] with the row's first document, a [SEP]
    with the document before it, a document continuing into the next row is that row's document 0; read back by
    the pretraining loop's reader as the (B, T) document ids the model takes."""
    import numpy as np
    import pyarrow as pa
    import pytest

    from core.config import PretrainConfig
    from stages.pretrain import objective_for
    from stages.pretrain.data import Sequences
    from stages.tokenize import DOC_INDEX_COLUMN, pack, row_documents, to_table

    docs = [[10, 11, 12], [20, 21], [], [30, 31, 32, 33, 34]]  # rows of 8: 6 content tokens each
    rows, lengths, first = pack(docs, 8, cls_id=1, sep_id=2, pad_id=0)
    index = row_documents(docs, 8)
    # the [SEP] closing [20, 21] falls into row 2, ahead of the last document
    assert rows.tolist() == [[1, 10, 11, 12, 2, 20, 21, 2], [1, 2, 30, 31, 32, 33, 34, 2]]
    assert index.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]] and index.dtype == np.uint16
    long_docs = [[5] * 9, [6]]  # the first document spans two rows: the second starts inside it
    assert row_documents(long_docs, 8).tolist() == [[0] * 8, [0, 0, 0, 0, 0, 1, 1, 1]]  # [CLS] 5 5 5 [SEP] 6 [SEP] pad
    with pa.ipc.new_file(str(tmp_path / "part.arrow"), (t := to_table(rows, lengths, ["a", "d"], doc_index=index)).schema) as w:
        w.write_table(t)
    objective = objective_for(PretrainConfig(document_mask=True))
    assert objective.shard_columns == ("input_ids", DOC_INDEX_COLUMN)
    batch = objective.batch(Sequences([tmp_path / "part.arrow"], objective.shard_columns).take(np.array([1, 0])))
    assert batch["document_ids"].tolist() == index[[1, 0]].tolist()
    with pa.ipc.new_file(str(tmp_path / "old.arrow"), (t := to_table(rows, lengths, ["a", "d"])).schema) as w:
        w.write_table(t)  # a shard from before the column: readable, and refused only when the column is asked for
    assert len(Sequences([tmp_path / "old.arrow"], ["input_ids"])) == 2
    with pytest.raises(RuntimeError, match="no column doc_index.*--force tokenize"):
        Sequences([tmp_path / "old.arrow"], ["input_ids", DOC_INDEX_COLUMN])


def test_only_an_objective_that_reads_documents_takes_the_option():
    """The objective says whether it reads document boundaries (`reads_documents`); the others refuse the option
    before any stage, naming the fix."""
    from core.config import ConfigError, PretrainConfig
    from deberta.config import debug
    from stages.pretrain.objectives import check_config

    check_config(PretrainConfig(document_mask=True), debug(vocab_size=300))
    for cfg in (PretrainConfig(document_mask=True, objective="rtd"), PretrainConfig(document_mask=True, sop=True)):
        with pytest.raises(ConfigError, match="does not read document boundaries; use objective=mlm without sop"):
            check_config(cfg, debug(vocab_size=300))
