"""Packed documents: attention and positions restart after each end-of-text token
(data.reset_attention_at_eos), and no loss is taken where the input is one (data.mask_eod_loss).

In one process: the documents and positions of a sample's tokens, the document mask (a boolean
mask for scaled_dot_product_attention, and FlexAttention's block mask, run here by its eager
reference) against attention run per document in fp32, each family's model on a packed sample
against its documents run alone, context parallelism's chunks against the whole masked
attention, the labels and the loss weights a micro-batch gets, and the config's refusal.
The layouts (t = 2, p = 2, cp = 2) against one process are tests/test_family_training.py's and
tests/test_context_parallel.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_runs import TINY, registered

from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.model import build
from hpcllm.model.documents import (
    IGNORE,
    DocumentMasks,
    attention_mask,
    chunk_masks,
    document_ids,
    document_positions,
    masked_attention,
)
from hpcllm.parallel.context import ContextParallel, chunk_positions
from hpcllm.train.stage_work import StageBatches

EOS = 9


def test_a_token_belongs_to_the_document_its_eos_ends_and_counts_from_its_start():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 8], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    docs = document_ids(ids, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(docs).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]


def _per_document(q, k, v, docs, gqa):
    """Causal attention run on each document alone: the reference."""
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        for doc in docs[row].unique():
            at = (docs[row] == doc).nonzero().flatten()
            out[row, :, at] = F.scaled_dot_product_attention(
                q[row : row + 1, :, at],
                k[row : row + 1, :, at],
                v[row : row + 1, :, at],
                is_causal=True,
                enable_gqa=gqa,
            )[0]
    return out


def _packed(b, s, gen):
    ids = torch.randint(0, EOS, (b, s), generator=gen)
    ids[torch.rand(b, s, generator=gen) < 0.15] = EOS
    return ids


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("flex", [False, True], ids=["sdpa-mask", "flex"])
def test_document_masked_attention_equals_attention_run_per_document(kv_heads, flex):
    gen = torch.Generator().manual_seed(kv_heads)
    b, heads, s, d = 2, 4, 48, 8
    q = torch.randn(b, heads, s, d, generator=gen)
    k = torch.randn(b, kv_heads, s, d, generator=gen)
    v = torch.randn(b, kv_heads, s, d, generator=gen)
    docs = document_ids(_packed(b, s, gen), EOS)
    assert docs[:, -1].min() >= 3  # several documents a row
    gqa = kv_heads != heads
    want = _per_document(q, k, v, docs, gqa)
    mask = attention_mask(docs, flex)
    assert isinstance(mask, torch.Tensor) != flex
    eager = None
    if flex:  # its eager reference on the CPU: the block mask's meaning, not its speed
        from torch.nn.attention.flex_attention import flex_attention

        eager = flex_attention
    got = masked_attention(q, k, v, mask, gqa=gqa, flex=eager)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Not causal attention over the whole row: the mask does something.
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=gqa))  # fmt: skip


@pytest.mark.parametrize("arch", registered())
def test_a_packed_sample_gives_each_document_the_logits_it_has_alone(arch):
    """Positions restart (learned for GPT-2, rotary for Llama) and attention stays inside a
    document: each document's logits in the packed sample are its logits run alone."""
    cfg = load_config(None, [f"model.arch={arch}", *TINY[arch], "model.dropout=0"]).model
    model = build(cfg, 64).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, EOS, (2, 32), generator=gen)
    ids[0, [4, 5, 17, 30]] = EOS
    ids[1, [0, 12]] = EOS
    docs = document_ids(ids, EOS)
    with torch.no_grad():
        packed = model(ids, documents=docs)
        for row in range(2):
            for doc in docs[row].unique():
                at = (docs[row] == doc).nonzero().flatten()
                alone = model(ids[row : row + 1, at])[0]
                torch.testing.assert_close(packed[row, at], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed, model(ids), atol=1e-4)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_chunks_under_document_masks_equal_the_whole_masked_attention(cp):
    gen = torch.Generator().manual_seed(cp)
    b, heads, s, d = 2, 4, 8 * cp, 8
    q = torch.randn(b, heads, s, d, generator=gen)
    k = torch.randn(b, 2, s, d, generator=gen)
    v = torch.randn(b, 2, s, d, generator=gen)
    docs = document_ids(_packed(b, s, gen), EOS)
    whole = masked_attention(q, k, v, attention_mask(docs, False), gqa=True)
    order = torch.cat([chunk_positions(s, cp, r) for r in range(cp)])
    for r in range(cp):
        context = ContextParallel(None, cp, r, s)
        mine = context.positions(q.device)
        masks = chunk_masks(docs, context)
        got = context.attend(q[:, :, mine], k[:, :, order], v[:, :, order], gqa=True, masks=masks)
        torch.testing.assert_close(got, whole[:, :, mine], rtol=1e-6, atol=1e-6)


def test_a_micro_batch_masks_the_labels_at_eos_and_weights_cp_chunks_to_the_sample_mean():
    gen = torch.Generator().manual_seed(3)
    ids = _packed(2, 16, gen)
    labels = torch.randint(0, EOS, (2, 16), generator=gen)
    masks = DocumentMasks(EOS, reset_attention=True, mask_loss=True)
    (got_ids, got_labels), = [StageBatches([(ids, labels)], None, masks)[0]]  # fmt: skip
    assert torch.equal(got_ids, ids)
    assert torch.equal(got_labels == IGNORE, ids == EOS) and (ids == EOS).any()
    assert torch.equal(got_labels[ids != EOS], labels[ids != EOS])
    keywords = StageBatches([(ids, labels)], None, masks).keywords(0)
    assert torch.equal(keywords["documents"], document_ids(ids, EOS))
    # Each cp rank's own mean, weighted, averages over the group to the sample's mean.
    losses = torch.rand(2, 16, generator=gen)
    counted = got_labels >= 0
    want = losses[counted].mean()
    shares = []
    for r in range(4):
        batches = StageBatches([(ids, labels)], ContextParallel(None, 4, r, 16), masks)
        _, cut = batches[0]
        mine = chunk_positions(16, 4, r)
        assert torch.equal(cut, got_labels[:, mine])
        own = losses[:, mine][cut >= 0]
        shares.append((own.mean() if own.numel() else torch.zeros(())) * batches.loss_weight(0))
    torch.testing.assert_close(torch.stack(shares).mean(), want)
    # Off, nothing changes and the forward takes no keyword.
    plain = StageBatches([(ids, labels)], None, DocumentMasks(EOS))
    assert torch.equal(plain[0][1], labels) and plain.keywords(0) == {}
    assert plain.loss_weight(0) is None


@pytest.mark.parametrize("which", ["reset_attention_at_eos", "mask_eod_loss"])
def test_document_masks_on_synthetic_ids_are_refused_in_one_line(which):
    with pytest.raises(UserError, match=f"data.{which} acts at end-of-text tokens"):
        load_config(None, ["data.synthetic=true", f"data.{which}=true"])
