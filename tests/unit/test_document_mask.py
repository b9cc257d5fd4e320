"""Packed rows without cross-document attention: a document's states in a packed row are its states alone."""

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


def test_each_document_in_a_packed_row_equals_the_document_alone():
    model = DebertaModel(CFG).eval()
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
