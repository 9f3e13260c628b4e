"""The documents packed into a sample: where attention and positions restart, which labels count.

A prepared sample is a window of the token stream, so it packs the end of one document, whole
documents and the start of another, each ended by the end-of-text token (EOS). Two settings
change how a sample is read (docs/data.md):

- ``data.reset_attention_at_eos``: a token attends only to the tokens of its own document and
  takes its position within it, 0 at the token after an EOS (Llama 3 trained so: The Llama 3
  Herd of Models, section 3.2). A token's document is the number of EOS before it in the
  sample, so the EOS ends its own document. On CUDA the mask is a FlexAttention block mask
  (``torch.nn.attention.flex_attention``: blocks wholly outside every document are skipped);
  elsewhere, and with attention dropout, which FlexAttention does not take, a boolean mask
  for ``scaled_dot_product_attention``.
- ``data.mask_eod_loss``: no loss where the input token is EOS (Megatron-LM's
  ``--eod-mask-loss``), so the model is not asked to guess the first token of an unrelated
  document. The label there becomes :data:`IGNORE` and a micro-batch's loss is the mean over
  the labels that count.

Everything here is a function of the token ids alone, so every rank of a layout (each
pipeline stage, each tensor-parallel rank, each context-parallel rank before its cut) derives
the same documents from the micro-batch it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpcllm.parallel.context import ContextParallel, masked_sdpa

# A label that takes no loss (PyTorch's ignore_index); every label under 0 is one.
IGNORE = -100

# On CUDA the document mask is a FlexAttention block mask; False (or another device) uses a
# boolean mask with scaled_dot_product_attention.
FLEX_ON_CUDA = True


@dataclass(frozen=True)
class DocumentMasks:
    """What a run does at each end-of-text token ``eos_id`` of its samples: restart
    attention and positions (``reset_attention``), take no loss (``mask_loss``)."""

    eos_id: int
    reset_attention: bool = False
    mask_loss: bool = False

    def __post_init__(self) -> None:
        if self.reset_attention:
            masks_ready()

    @classmethod
    def of(cls, data: Any, eos_id: int | None) -> DocumentMasks | None:
        """Return what the data section ``data`` (:class:`hpcllm.config.DataConfig`) asks of
        the end-of-text token ``eos_id``: None where it asks nothing."""
        if not (data.reset_attention_at_eos or data.mask_eod_loss):
            return None
        if eos_id is None:
            raise ValueError("the data's tokenizer has no end-of-text token")
        return cls(eos_id, data.reset_attention_at_eos, data.mask_eod_loss)

    def labels(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return ``labels`` with :data:`IGNORE` where the input token is EOS (under
        ``mask_loss``; else ``labels`` as they are)."""
        if not self.mask_loss:
            return labels
        return labels.masked_fill(ids == self.eos_id, IGNORE)

    def keywords(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return the model's forward keywords for the whole samples ``ids`` (b, s): each
        token's ``documents`` (its document's index in the sample), from which the model
        takes the mask and the positions (:meth:`hpcllm.model.decoder.Decoder.forward`);
        none unless ``reset_attention``."""
        if not self.reset_attention:
            return {}
        return {"documents": document_ids(ids, self.eos_id)}


def document_ids(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Return each token's document in its sample (b, s): the number of EOS before it."""
    ends = (ids == eos_id).to(torch.int32)
    return ends.cumsum(dim=-1, dtype=torch.int32) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Return each token's position in its document (b, s), int64: 0 at a document's first
    token (the sample's first token too, whatever came before it in the stream)."""
    s = documents.shape[-1]
    index = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def dense_mask(query_docs: torch.Tensor, key_docs: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Return the boolean mask (b, 1, queries, keys) of causal attention within documents
    (True: attend): query i (at key position i + ``offset``) sees the keys at or before it
    in its own document."""
    lq, lk = query_docs.shape[-1], key_docs.shape[-1]
    rows = torch.arange(lq, device=query_docs.device)[:, None] + offset
    causal = torch.arange(lk, device=query_docs.device)[None, :] <= rows
    same = query_docs[:, :, None] == key_docs[:, None, :]
    return (causal & same)[:, None]


def chunk_masks(documents: torch.Tensor, context: ContextParallel) -> list[torch.Tensor]:
    """Return the boolean masks (b, 1, s/(2·cp), keys) of this context-parallel rank's two
    chunks over the keys up to each chunk's end, causal within the packed documents
    ``documents`` (b, s) of the whole sample (what :meth:`ContextParallel.attend` takes)."""
    c = context.seq_len // (2 * context.size)
    masks = []
    for chunk in (context.rank, 2 * context.size - 1 - context.rank):
        end = (chunk + 1) * c
        masks.append(dense_mask(documents[:, chunk * c : end], documents[:, :end], end - c))
    return masks


def flex_wanted(device: torch.device, dropout_p: float) -> bool:
    """Return whether the mask for ``device`` is a FlexAttention block mask: on CUDA (as
    :data:`FLEX_ON_CUDA` says), without attention dropout."""
    return FLEX_ON_CUDA and device.type == "cuda" and dropout_p == 0


_eager: list[Any] = []


def masks_ready() -> None:
    """Make, once, the mask maker the compiler leaves alone and the compiled FlexAttention:
    before a compiled model first calls them (a run's :class:`DocumentMasks` does), so that
    no compiled graph makes them; not at import, where torch.compiler would import Triton."""
    if not _eager:
        _eager.append(torch.compiler.disable(_make_mask))
    if not _compiled_flex:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex.append(torch.compile(flex_attention, dynamic=False))


def attention_mask(documents: torch.Tensor, flex: bool) -> Any:
    """Return the within-document causal mask of a sample's tokens, ``documents`` (b, s): a
    FlexAttention ``BlockMask`` where ``flex``, else a boolean tensor (b, 1, s, s). Made
    outside any compiled graph, once per forward, for every block."""
    masks_ready()
    return _eager[0](documents, flex)


def _make_mask(documents: torch.Tensor, flex: bool) -> Any:
    if not flex:
        return dense_mask(documents, documents)
    from torch.nn.attention.flex_attention import create_block_mask

    def within_document(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (k <= q) & (documents[b, q] == documents[b, k])

    b, s = documents.shape
    # Compiled, the block mask is made block by block; eager, torch makes the whole (b, s, s)
    # mask first. Eager off CUDA, where only the tests make a block mask (its meaning).
    return create_block_mask(
        within_document,
        b,
        None,
        s,
        s,
        device=documents.device,
        _compile=documents.device.type == "cuda",
    )


_eager: list[Any] = []  # the mask maker, disabled for the compiler
_compiled_flex: list[Any] = []  # FlexAttention compiled: uncompiled it is an unfused reference


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    dropout_p: float = 0.0,
    gqa: bool = False,
    flex: Any = None,
) -> torch.Tensor:
    """Return attention of ``q`` over ``k`` and ``v`` (b, heads, s, d) under ``mask``, which
    :func:`attention_mask` made: FlexAttention for a block mask (``flex``: the function to
    call; None: the compiled one), else scaled_dot_product_attention."""
    if isinstance(mask, torch.Tensor):
        return masked_sdpa(q, k, v, mask, dropout_p, gqa)
    if dropout_p:
        raise ValueError("FlexAttention takes no attention dropout; use a boolean mask")
    if flex is None:
        masks_ready()
        flex = _compiled_flex[0]
    return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
