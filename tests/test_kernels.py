"""The Triton kernels, through the dispatch and the ``hpcllm`` custom ops, against the references.

With a CUDA GPU the compiled kernels run on it; without one they run on the CPU under Triton's
interpreter. The ``ops`` fixture is the dispatch (:mod:`hpcllm.kernels`) with kernels enabled.
``TRITON_INTERPRET=1`` must be set when Triton itself is first imported (its library functions
are decorated then), so this file imports Triton at collection, before any
test has run (a test's ``torch.utils.checkpoint`` imports Triton too), and restores the
variable at once; the module fixture sets it again for this file's tests only, so that it is
set when our kernels are jitted, at their first launch (:mod:`hpcllm.kernels.jit`). Every
kernel runs with its outputs pre-filled with NaN, so an element it fails to write shows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcllm import kernels
from hpcllm.config import ModelConfig, model_config
from hpcllm.errors import UserError
from hpcllm.kernels import reference
from hpcllm.kernels.timing import Clock
from hpcllm.model.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 17), (7, 96), (33, 257), (2, 3, 1000)]
# Kernels compute in fp32 and round once to the output dtype: relative error about one ulp.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _import_kernels():
    """Return the launchers' shared module, Triton imported for the interpreter off CUDA."""
    if CUDA:
        from hpcllm.kernels import launch

        return launch
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.random.rand, InterpretedFunction):
            raise RuntimeError(
                "Triton was imported before TRITON_INTERPRET=1 was set (by a "
                "file collected earlier); run tests/test_kernels.py on its own"
            )
        from hpcllm.kernels import launch
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return launch


launch = _import_kernels()


@pytest.fixture(scope="module", autouse=True)
def ops():
    saved = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    kernels.set_enabled(True)
    with launch.poisoned_outputs():
        yield kernels
    kernels.set_enabled(False)
    if saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved


def close(actual, expected, dtype=None, scale_atol=None):
    """Assert actual ≈ expected (fp32 oracle) within the tolerance of ``dtype``."""
    dtype = dtype or actual.dtype
    assert not actual.isnan().any(), "NaN: an output element was not written"
    expected = expected.float()
    atol = (scale_atol or RTOL[dtype] / 10) * max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(actual.float(), expected, rtol=RTOL[dtype], atol=atol)


def leaf(t, dtype=torch.float32):
    return t.to(DEVICE, dtype).requires_grad_()


def dev(t):
    return t.to(DEVICE)


def grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


class FakeClock(Clock):
    """A clock that runs a callable once and makes its time of what the run ran and returned:
    the elements of its first output (the op's output, or the first gradient), times 10 for a
    run that returns gradients, times ``triton[op]`` (1 unless given) for a run of a Triton
    kernel, else times ``others`` (2). So the same op, shape, pass and implementation take the
    same time whoever times them. ``timed`` lists what each run ran: its Triton op, or "torch"."""

    def __init__(self, triton=None, others=2.0):
        super().__init__()
        self.triton, self.others, self.timed = triton or {}, others, []

    def median_ms(self, fn, device):
        kernels.reset_implementations_used()
        out = fn()
        ran = [op for op, impl in kernels.implementations_used().items() if impl == "triton"]
        self.timed.append(ran[0] if ran else "torch")
        first = out if isinstance(out, torch.Tensor) else out[0]
        factor = self.triton.get(ran[0], 1.0) if ran else self.others
        return first.numel() * (1 if isinstance(out, torch.Tensor) else 10) * factor


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_gelu_and_its_gradients_match_the_reference(ops, shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x = leaf(torch.randn(shape, generator=gen) * 3, dtype)
    bias = leaf(torch.randn(shape[-1], generator=gen))
    y = ops.bias_gelu(x, bias)
    assert y.dtype == dtype and y.shape == x.shape
    x32 = leaf(x.detach().float())
    ref = reference.bias_gelu(x32, bias)
    close(y, ref)
    dy = dev(torch.randn(shape, generator=gen)).to(dtype)
    dx, dbias = grads(y, (x, bias), dy)
    ref_dx, ref_dbias = grads(ref, (x32, bias), dy.float())
    close(dx, ref_dx)
    close(dbias, ref_dbias, dtype, scale_atol=RTOL[dtype])  # summed from fp32 values


@pytest.mark.gpu
def test_bias_gelu_without_bias(ops):
    x = leaf(torch.randn(5, 33))
    y = ops.bias_gelu(x, None)
    close(y, reference.bias_gelu(x, None))
    close(
        grads(y, x, torch.ones_like(y))[0],
        grads(reference.bias_gelu(x, None), x, torch.ones_like(y))[0],
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_add_without_dropout_matches_the_reference(ops, shape, dtype):
    gen = torch.Generator().manual_seed(2)
    x = leaf(torch.randn(shape, generator=gen), dtype)
    bias = leaf(torch.randn(shape[-1], generator=gen))
    residual = leaf(torch.randn(shape, generator=gen))
    for p, training in ((0.0, True), (0.5, False)):
        out = ops.bias_dropout_add(x, bias, residual, p, training)
        # Promoted like the reference: bf16 activations + fp32 residual give fp32.
        assert out.dtype == torch.float32
        ref = reference.bias_dropout_add(x, bias, residual, p, training)
        close(out, ref)
        dy = dev(torch.randn(shape, generator=gen))
        for got, want in zip(
            grads(out, (x, bias, residual), dy), grads(ref, (x, bias, residual), dy), strict=True
        ):
            assert got.dtype == want.dtype
            close(got, want)


@pytest.mark.gpu
def test_bias_dropout_add_without_bias(ops):
    x, residual = leaf(torch.randn(6, 40)), leaf(torch.randn(6, 40))
    out = ops.bias_dropout_add(x, None, residual, 0.0, True)
    close(out, x + residual)
    torch.manual_seed(0)
    out = ops.bias_dropout_add(x, None, residual, 0.5, True)
    kept = out != residual
    close(out[kept], (residual + 2 * x)[kept])
    dx, dres = grads(out, (x, residual), torch.ones_like(out))
    assert torch.equal(dx, kept.float() * 2) and torch.equal(dres, torch.ones_like(out))


def _dropout(ops, seed, p=0.3, shape=(64, 1000), dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    x = leaf(torch.rand(shape, generator=gen) + 1.0, dtype)  # never 0: kept elements change
    bias = leaf(torch.rand(shape[-1], generator=gen))
    residual = leaf(torch.randn(shape, generator=gen))
    torch.manual_seed(seed)
    out = ops.bias_dropout_add(x, bias, residual, p, True)
    return x, bias, residual, out


@pytest.mark.gpu
def test_dropout_keeps_1_minus_p_of_the_elements_scaled(ops):
    p = 0.3
    x, bias, residual, out = _dropout(ops, seed=7, p=p)
    kept = out != residual
    n = kept.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5)
    close(out[kept], (residual + (x + bias) / (1 - p))[kept])
    assert torch.equal(out[~kept], residual[~kept])
    # Each element draws its own number: rows and columns do not repeat one pattern.
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[:, 0], kept[:, 1])
    # Another seed draws an independent mask: both keep an element (1-p)^2 of the time.
    other = _dropout(ops, seed=8, p=p)[3] != residual
    assert abs((kept & other).float().mean().item() - (1 - p) ** 2) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_backward_uses_the_forward_mask(ops, dtype):
    p = 0.25
    x, bias, residual, out = _dropout(ops, seed=11, p=p, shape=(33, 257), dtype=dtype)
    kept = out != residual
    dy = dev(torch.randn(out.shape))
    dx, dbias, dres = grads(out, (x, bias, residual), dy)
    expected = torch.where(kept, dy / (1 - p), 0.0)
    assert dx.dtype == dtype and dbias.dtype == torch.float32
    close(dx, expected)
    close(dbias, expected.sum(0), torch.float32, scale_atol=1e-6)
    assert torch.equal(dres, dy)


@pytest.mark.slow
@pytest.mark.gpu
def test_dropout_mask_follows_torch_seed_and_fork_rng(ops):
    first = _dropout(ops, seed=5)[3]
    assert torch.equal(first, _dropout(ops, seed=5)[3])
    assert not torch.equal(first, _dropout(ops, seed=6)[3])
    x, bias, residual, _ = _dropout(ops, seed=5)
    torch.manual_seed(5)
    with torch.random.fork_rng(devices=[]):
        ops.bias_dropout_add(x, bias, residual, 0.3, True)
    assert torch.equal(ops.bias_dropout_add(x, bias, residual, 0.3, True), first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_and_its_gradients_match_the_reference(ops, shape, dtype):
    gen = torch.Generator().manual_seed(4)
    # An offset mean: a one-pass E[x²] - E[x]² would lose the variance in fp32.
    x = leaf(torch.randn(shape, generator=gen) * 2 + 50, dtype)
    w = leaf(torch.randn(shape[-1], generator=gen))
    b = leaf(torch.randn(shape[-1], generator=gen))
    y = ops.layer_norm(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    x32 = leaf(x.detach().float())
    ref = reference.layer_norm(x32, w, b, 1e-5)
    # fp32: x - mean loses log2(50 / 2) bits to the offset, and the row sums differ in order.
    atol = max(RTOL[dtype], 5e-5)
    close(y, ref, scale_atol=atol)
    dy = dev(torch.randn(shape, generator=gen)).to(dtype)
    dx, dw, db = grads(y, (x, w, b), dy)
    ref_dx, ref_dw, ref_db = grads(ref, (x32, w, b), dy.float())
    close(dx, ref_dx, scale_atol=atol)
    # 33 and 6 rows: each of the interpreter's persistent programs walks several rows.
    close(dw, ref_dw, dtype, scale_atol=atol)
    close(db, ref_db, dtype, scale_atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_and_its_gradients_match_the_reference(ops, shape, dtype):
    # The reference rounds the normalised row to x's dtype before the fp32 weight, as the
    # kernel does: compared on the same inputs, they differ by a rounding of that dtype.
    gen = torch.Generator().manual_seed(11)
    x = leaf(torch.randn(shape, generator=gen) * 2 + 3, dtype)
    w = leaf(torch.randn(shape[-1], generator=gen))
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.promote_types(dtype, torch.float32) and y.shape == x.shape
    x_ref = leaf(x.detach().clone(), dtype)
    ref = reference.rms_norm(x_ref, w, 1e-6)
    close(y, ref, dtype)
    dy = dev(torch.randn(shape, generator=gen))
    dx, dw = grads(y, (x, w), dy)
    ref_dx, ref_dw = grads(ref, (x_ref, w), dy)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    close(dx, ref_dx, dtype, scale_atol=RTOL[dtype])
    close(dw, ref_dw, dtype, scale_atol=RTOL[dtype])  # summed over rows from fp32 values


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_and_its_gradients_match_the_reference(ops, shape, dtype):
    gen = torch.Generator().manual_seed(12)
    gate = leaf(torch.randn(shape, generator=gen) * 3, dtype)
    up = leaf(torch.randn(shape, generator=gen), dtype)
    y = ops.swiglu(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    g32, u32 = leaf(gate.detach().float()), leaf(up.detach().float())
    ref = reference.swiglu(g32, u32)
    close(y, ref)
    dy = dev(torch.randn(shape, generator=gen)).to(dtype)
    dgate, dup = grads(y, (gate, up), dy)
    ref_dgate, ref_dup = grads(ref, (g32, u32), dy.float())
    close(dgate, ref_dgate)
    close(dup, ref_dup)


def _llama31_inv_freq(head_dim: int) -> torch.Tensor:
    """Llama 3.1's scaled rotary frequencies for one head (factor 8, low 1, high 4, 32 long)."""
    from hpcllm.model.llama import rope_frequencies

    cfg = model_config(
        "llama", preset=None, n_layer=1, n_head=1, d_model=head_dim, seq_len=64,
        rope_theta=500000.0, rope_scaling=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_seq_len=32,
    )  # fmt: skip
    return rope_frequencies(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "offset"), [((2, 5, 3, 8), 0), ((1, 17, 2, 64), 0), ((3, 33, 1, 6), 7)], ids=str
)
def test_rotary_and_its_gradient_match_the_reference(ops, shape, offset, dtype):
    # (batch, seq, heads, head_dim), positions from offset, Llama 3.1's scaled frequencies.
    gen = torch.Generator().manual_seed(13)
    inv_freq = dev(_llama31_inv_freq(shape[-1]))
    assert len(set(inv_freq.tolist())) == shape[-1] // 2  # scaled, unscaled and blended
    x = leaf(torch.randn(shape, generator=gen) * 2, dtype)
    y = ops.rotary(x, inv_freq, offset)
    assert y.dtype == dtype and y.shape == x.shape
    x32 = leaf(x.detach().float())
    ref = reference.rotary(x32, inv_freq, offset)
    close(y, ref, scale_atol=max(RTOL[dtype] / 10, 1e-6))  # angles up to 39 rad: cos, sin ulps
    dy = dev(torch.randn(shape, generator=gen)).to(dtype)
    (dx,) = grads(y, (x,), dy)
    (ref_dx,) = grads(ref, (x32,), dy.float())
    close(dx, ref_dx, scale_atol=max(RTOL[dtype] / 10, 1e-6))
    # A rotation keeps each pair's length: the kernel's, in fp32, to rounding.
    if dtype == torch.float32:
        norms = (y.detach() ** 2).reshape(-1, 2, shape[-1] // 2).sum(1)
        want = (x.detach() ** 2).reshape(-1, 2, shape[-1] // 2).sum(1)
        torch.testing.assert_close(norms, want, rtol=1e-5, atol=1e-5)


def _positions(kind, batch, seq, gen):
    """Return the positions of (batch, seq) tokens of ``kind``: (seq,) or (batch, seq)."""
    if kind == "permuted":  # any order
        return torch.randperm(seq, generator=gen)
    if kind == "repeated":  # several tokens at one position; int32
        return torch.randint(0, 4, (seq,), generator=gen, dtype=torch.int32)
    if kind == "two-chunks":  # a context-parallel rank's chunks 1 and 6 of 8 (zig-zag)
        c = seq // 2
        return torch.cat([torch.arange(c, 2 * c), torch.arange(6 * c, 7 * c)])
    if kind == "one-row":  # (1, seq): broadcast over the batch
        return (torch.arange(seq) + 40).unsqueeze(0)
    # per-sequence: packed documents of other lengths in each row, positions restarting
    return torch.stack([torch.arange(seq) % (3 + 2 * r) for r in range(batch)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "kind", ["permuted", "repeated", "two-chunks", "one-row", "per-sequence"], ids=str
)
@pytest.mark.parametrize("shape", [(2, 12, 3, 8), (3, 18, 2, 64)], ids=str)
def test_rotary_at_any_positions_matches_the_reference(ops, shape, kind, dtype):
    """Positions as a tensor, (s,) or (b, s): the kernel, forward and backward, against the
    reference in fp32 (relative 1e-6 in fp32, the other ops' tolerances in bf16 and fp16)."""
    gen = torch.Generator().manual_seed(14)
    inv_freq = dev(_llama31_inv_freq(shape[-1]))
    positions = dev(_positions(kind, shape[0], shape[1], gen))
    x = leaf(torch.randn(shape, generator=gen) * 2, dtype)
    kernels.reset_implementations_used()
    y = ops.rotary(x, inv_freq, positions)
    assert kernels.implementations_used() == {"rotary": "triton"}
    assert y.dtype == dtype and y.shape == x.shape
    x32 = leaf(x.detach().float())
    ref = reference.rotary(x32, inv_freq, positions)
    dy = dev(torch.randn(shape, generator=gen)).to(dtype)
    (dx,) = grads(y, (x,), dy)
    (ref_dx,) = grads(ref, (x32,), dy.float())
    for got, want in ((y, ref), (dx, ref_dx)):
        if dtype == torch.float32:
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale)
        else:
            close(got, want, scale_atol=RTOL[dtype] / 10)


@pytest.mark.gpu
def test_rotary_positions_are_each_tokens_own(ops):
    """The offset form is the tensor form of offset … offset + s - 1; a context-parallel
    rank's two chunks rotate as they do in the whole sequence; a (b, s) call is each
    sequence's (s,) call. Bitwise: each element's angle is the same fp32 product."""
    gen = torch.Generator().manual_seed(15)
    inv_freq = dev(_llama31_inv_freq(8))
    x = leaf(torch.randn(2, 24, 3, 8, generator=gen))
    whole = ops.rotary(x, inv_freq, 0)
    assert torch.equal(
        ops.rotary(x, inv_freq, 5), ops.rotary(x, inv_freq, dev(torch.arange(5, 29)))
    )
    chunks = dev(torch.cat([torch.arange(3, 6), torch.arange(18, 21)]))
    assert torch.equal(ops.rotary(x[:, chunks], inv_freq, chunks), whole[:, chunks])
    per_row = dev(torch.stack([torch.randperm(24, generator=gen), torch.arange(24) % 7]))
    rows = ops.rotary(x, inv_freq, per_row)
    for r in range(2):
        assert torch.equal(rows[r : r + 1], ops.rotary(x[r : r + 1], inv_freq, per_row[r]))
    for wrong in (torch.arange(23), torch.zeros(3, 24, dtype=torch.long)):
        with pytest.raises(ValueError, match="rotary positions"):
            ops.rotary(x, inv_freq, dev(wrong))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 17), (7, 96), (33, 257), (5, 1000), (3, 5000)], ids=str)
def test_cross_entropy_and_its_gradient_match_the_reference(ops, shape, dtype):
    rows, cols = shape
    gen = torch.Generator().manual_seed(5)
    logits = leaf(torch.randn(shape, generator=gen) * 4, dtype)
    labels = dev(torch.randint(0, cols, (rows,), generator=gen))
    loss = ops.cross_entropy(logits, labels)
    ref = reference.cross_entropy(logits, labels)
    assert loss.dtype == torch.float32
    close(loss, ref, torch.float32)
    close(grads(loss, logits, None)[0], grads(ref, logits, None)[0])


@pytest.mark.gpu
def test_cross_entropy_excludes_padding_and_reads_a_strided_view(ops):
    gen = torch.Generator().manual_seed(6)
    full = leaf(torch.randn(2, 9, 384, generator=gen), torch.bfloat16)
    labels = dev(torch.randint(0, 300, (2, 9), generator=gen))
    ref = reference.cross_entropy(full, labels, 300)
    ref_grad = grads(ref, full, None)[0]
    padded = ops.cross_entropy(full, labels, 300)
    grad = grads(padded, full, None)[0]
    close(padded, ref, torch.float32)
    close(grad, ref_grad)
    assert torch.equal(grad[..., 300:], torch.zeros_like(grad[..., 300:]))
    sliced = full[..., :300]  # what GPT.head passes: rows 384 apart
    assert not sliced.is_contiguous()
    close(ops.cross_entropy(sliced, labels), ref, torch.float32)
    close(grads(ops.cross_entropy(sliced, labels), full, None)[0], ref_grad)


@pytest.mark.gpu
def test_cross_entropy_leaves_out_the_labels_that_do_not_count(ops):
    """A label under 0 (data.mask_eod_loss's) takes no loss and gets no gradient: the mean is
    PyTorch's with ignore_index; with none counted the loss and its gradient are 0."""
    gen = torch.Generator().manual_seed(8)
    logits = leaf(torch.randn(3, 7, 384, generator=gen) * 3, torch.bfloat16)
    labels = torch.randint(0, 300, (3, 7), generator=gen)
    labels[0, 2] = labels[1, :5] = labels[2, 6] = -100
    labels = dev(labels)
    want = torch.nn.functional.cross_entropy(
        logits[..., :300].float().reshape(-1, 300), labels.reshape(-1), ignore_index=-100
    )
    want_grad = grads(want, logits, None)[0]
    for fn in (ops.cross_entropy, reference.cross_entropy):
        loss = fn(logits, labels, 300)
        close(loss, want, torch.float32)
        grad = grads(loss, logits, None)[0]
        close(grad, want_grad)
        assert not grad[1, :5].any() and grad[1, 5:].any()
    none = dev(torch.full((3, 7), -100))
    for fn in (ops.cross_entropy, reference.cross_entropy):
        loss = fn(logits, none, 300)
        assert loss.item() == 0.0
        assert not grads(loss, logits, None)[0].any()


@pytest.mark.gpu
def test_cross_entropy_running_max_across_chunks(ops, monkeypatch):
    from hpcllm.kernels.ops import vocab_ce_partials

    monkeypatch.setattr(vocab_ce_partials, "CE_MAX_BLOCK", 64)  # 1000 columns: 16 chunks
    cols = torch.arange(1000, dtype=torch.float32)
    logits = torch.stack(
        [
            cols * 0.05,  # max grows in every chunk
            -cols * 0.05,  # max in the first chunk
            torch.where(cols == 999, 80.0, -80.0),  # one spike at the end
            torch.randn(1000) * 30,
        ]
    )
    logits = leaf(logits)
    labels = dev(torch.tensor([999, 0, 3, 500]))
    loss = ops.cross_entropy(logits, labels)
    ref = reference.cross_entropy(logits, labels)
    close(loss, ref)
    close(grads(loss, logits, None)[0], grads(ref, logits, None)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize(("vocab", "tp", "padded"), [(300, 3, 384), (100, 4, 512), (290, 3, 300)])
def test_vocab_parallel_partials_combine_to_the_whole_loss(ops, fused, vocab, tp, padded):
    """Slices as t ranks hold them; max and sums combined as the all-reduces would.

    Slices of 100 columns leave 28 masked lanes in the kernel's 128-wide block, where labels
    of the next slice must not be picked up.
    """
    kernels.set_enabled(fused)
    try:
        gen = torch.Generator().manual_seed(7)
        logits = dev(torch.randn(13, padded, generator=gen)).to(torch.bfloat16) * 3
        labels = dev(torch.randint(0, vocab, (13,), generator=gen))
        width = padded // tp
        slices = [logits[:, r * width : (r + 1) * width] for r in range(tp)]
        parts = [
            kernels.vocab_ce_partials(s, labels, r * width, vocab) for r, s in enumerate(slices)
        ]
        if vocab == 100:  # ranks 1..3 hold only padding
            assert all(torch.all(m == float("-inf")) and torch.all(s == 0) for m, s, _ in parts[1:])
        top = torch.stack([m for m, _, _ in parts]).max(dim=0).values
        total = sum(s * torch.exp(m - top) for m, s, _ in parts)
        target = sum(t for _, _, t in parts)
        lse = top + total.log()
        whole = leaf(logits[:, :vocab].float())
        ref = reference.cross_entropy(whole, labels)
        close((lse - target).mean(), ref, torch.float32)
        ref_grad = grads(ref, whole, None)[0]
        g = dev(torch.tensor(1.0 / 13))
        got = torch.cat(
            [
                kernels.vocab_ce_backward(s, labels, lse, g, r * width, vocab)
                for r, s in enumerate(slices)
            ],
            dim=1,
        )
        assert got.dtype == torch.bfloat16
        close(got[:, :vocab], ref_grad)
        assert torch.equal(got[:, vocab:], torch.zeros_like(got[:, vocab:]))
        # A per-row gradient (shape (rows,)) scales each row.
        rows = dev(torch.linspace(0.5, 2.0, 13))
        got_rows = kernels.vocab_ce_backward(slices[0], labels, lse, rows, 0, vocab)
        close(
            got_rows,
            kernels.vocab_ce_backward(slices[0], labels, lse, g, 0, vocab).float()
            * rows[:, None]
            * 13,
        )
    finally:
        kernels.set_enabled(True)


@pytest.mark.gpu
def test_dispatch_runs_triton_only_when_enabled_and_on_a_kernel_device(ops, monkeypatch):
    x = leaf(torch.randn(4, 8))
    kernels.reset_implementations_used()
    assert "hpcllm_bias_gelu" in kernels.bias_gelu(x, None).grad_fn.name()
    assert kernels.implementations_used() == {"bias_gelu": "triton"}
    kernels.set_enabled(False)
    try:
        assert not kernels.enabled()
        assert "hpcllm" not in kernels.bias_gelu(x, None).grad_fn.name()
        assert kernels.implementations_used() == {"bias_gelu": "torch"}
    finally:
        kernels.set_enabled(True)
    kernels.reset_implementations_used()
    assert kernels.implementations_used() == {}
    kernels.layer_norm(leaf(torch.randn(2, 0, 8)), leaf(torch.ones(8)), leaf(torch.zeros(8)), 1e-5)
    assert kernels.implementations_used() == {"layer_norm": "torch"}  # no rows: no launch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    on_cpu = x.detach().cpu().requires_grad_()
    assert "hpcllm" not in kernels.bias_gelu(on_cpu, None).grad_fn.name()  # no interpreter


def test_resolve_fused(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.resolve_fused("off", cuda) is False
    assert kernels.resolve_fused("auto", cpu) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert kernels.resolve_fused("auto", cuda) is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    assert kernels.resolve_fused("auto", cuda) is False  # V100: not a Triton target
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.resolve_fused("on", cpu) is True
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError, match="needs a CUDA device"):
        kernels.resolve_fused("on", cpu)
    assert kernels.resolve_fused("on", cuda) is True
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert kernels.resolve_fused("auto", cuda) is False
    with pytest.raises(UserError, match="needs Triton"):
        kernels.resolve_fused("on", cuda)
    with pytest.raises(UserError, match="need Triton"):
        kernels.set_enabled(True)


def test_each_op_is_its_module_read_from_its_line_in_ops():
    """What the package, the chooser and the bench know of an op comes from its module's
    ``OP``: the public function (signature and docstring), the reference, the custom op."""
    import inspect

    from hpcllm.bench import kernels as bench
    from hpcllm.kernels import choice, ops

    for op in kernels.OPS:
        public = getattr(kernels, op.name)
        assert public.__wrapped__ is op.fused and public.__doc__ == op.fused.__doc__
        assert inspect.signature(public) == inspect.signature(op.fused)
        assert getattr(reference, op.name) is op.reference
        assert isinstance(getattr(torch.ops.hpcllm, op.name), torch._ops.OpOverloadPacket)
    # The chooser times a backward for the ops whose line says they have one.
    assert choice.DIFFERENTIABLE is ops.DIFFERENTIABLE
    assert set(ops.DIFFERENTIABLE) == {
        "bias_gelu", "bias_dropout_add", "layer_norm", "cross_entropy", "rms_norm", "swiglu",
        "rotary",
    }  # fmt: skip
    assert bench.OPS == tuple(op.name for op in kernels.OPS if op.bench is not None)
    assert kernels.TRITON_IN_COMPILED_GRAPHS == {
        "cross_entropy", "vocab_ce_partials", "vocab_ce_backward"
    }  # fmt: skip


@pytest.mark.slow
def test_package_and_bench_import_without_triton_mpi_or_horovod():
    code = """
import sys
for name in ("triton", "mpi4py", "horovod"):
    sys.modules[name] = None  # importing it now raises ImportError
import torch
from hpcllm import kernels
import hpcllm.bench.kernels, hpcllm.model.gpt
assert not kernels.triton_available()
kernels.set_enabled(False)
x = torch.randn(3, 5)
assert torch.allclose(kernels.bias_gelu(x, None), kernels.reference.bias_gelu(x, None))
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, text=True, capture_output=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpcllm.kernels import ops
from hpcllm.kernels.jit import jitted

gelu, dropout, ln, partials, ce_bwd, rms, swiglu, rotary = (
    jitted(module) for module in (ops.bias_gelu, ops.bias_dropout_add, ops.layer_norm,
    ops.vocab_ce_partials, ops.vocab_ce_backward, ops.rms_norm, ops.swiglu, ops.rotary)
)
C, bf, f32, i32 = "constexpr", "*bf16", "*fp32", "i32"
tile = {"BLOCK_R": 4, "BLOCK_C": 1024}
rope = [bf, f32, "*i64", bf, i32, i32, i32, i32, i32, i32, "fp32", C, C, C, C]
cases = [
    (gelu.bias_gelu_fwd, [bf, f32, bf, i32, i32, C, C, C], dict(HAS_BIAS=True, **tile)),
    (gelu.bias_gelu_bwd, [bf, bf, f32, bf, f32, i32, i32, C, C, C], dict(HAS_BIAS=True, **tile)),
    (dropout.bias_dropout_add_fwd, [bf, f32, f32, f32, i32, i32, "fp32", "fp32", i32, C, C, C, C],
     dict(HAS_BIAS=True, DROPOUT=True, **tile)),
    (dropout.bias_dropout_add_bwd, [f32, bf, f32, i32, i32, "fp32", "fp32", i32, C, C, C, C],
     dict(HAS_BIAS=True, DROPOUT=True, **tile)),
    (ln.layer_norm_fwd, [f32, f32, f32, f32, f32, f32, i32, "fp32", C], dict(BLOCK=1024)),
    (ln.layer_norm_bwd, [f32, f32, f32, f32, f32, f32, f32, f32, i32, i32, C],
     dict(BLOCK=1024)),
    (partials.ce_partials, [bf, "*i64", f32, f32, f32, i32, i32, i32, i32, C], dict(BLOCK=4096)),
    (ce_bwd.ce_backward, [bf, "*i64", f32, f32, bf, i32, i32, i32, i32, i32, C],
     dict(BLOCK=4096)),
    (rms.rms_norm_fwd, [f32, f32, f32, f32, i32, "fp32", C], dict(BLOCK=1024)),
    (rms.rms_norm_fwd, [bf, f32, f32, f32, i32, "fp32", C], dict(BLOCK=1024)),
    (rms.rms_norm_bwd, [f32, bf, f32, f32, bf, f32, i32, i32, C], dict(BLOCK=1024)),
    (swiglu.swiglu_fwd, [bf, bf, bf, i32, i32, C, C], tile),
    (swiglu.swiglu_bwd, [bf, bf, bf, bf, bf, i32, i32, C, C], tile),
    (rotary.rotary_fwd, rope, dict(HAS_POSITIONS=False, HALF=64, BLOCK_R=32, BLOCK_H=64)),
    (rotary.rotary_fwd, rope, dict(HAS_POSITIONS=True, HALF=64, BLOCK_R=32, BLOCK_H=64)),
]
for fn, types, consts in cases:
    source = ASTSource(fn, dict(zip(fn.arg_names, types, strict=True)), constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert kernel.asm["cubin"], fn.__name__
print(len(cases))
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100_without_one():
    """The interpreter accepts code the compiler rejects: compile each kernel to sm_90 cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "15", out.stderr[-3000:]


def _small(**kw):
    cfg = dict(preset=None, n_layer=2, n_head=4, d_model=32, seq_len=16, dropout=0.0)
    cfg.update(kw)
    return ModelConfig(**cfg)


def _gpt_step(fused, precision=torch.float32, **cfg):
    return _model_step(lambda: GPT(_small(**cfg), 100, seed=3), fused, precision)


def _model_step(build, fused, precision=torch.float32):
    """Return (loss, gradients by name) of one training step of ``build()``'s model."""
    kernels.set_enabled(fused)
    try:
        model = build().to(DEVICE).train()
        gen = torch.Generator().manual_seed(1)
        ids = dev(torch.randint(0, 100, (3, 16), generator=gen))
        labels = dev(torch.randint(0, 100, (3, 16), generator=gen))
        torch.manual_seed(0)
        with torch.autocast(DEVICE.type, dtype=precision, enabled=precision != torch.float32):
            loss = model(ids, labels)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    finally:
        kernels.set_enabled(True)


def _count_calls(
    ops, monkeypatch, names=("bias_gelu", "bias_dropout_add", "layer_norm", "cross_entropy")
):
    calls = {}

    def counting(name, fn):
        def counted(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kw)

        return counted

    for name in names:
        monkeypatch.setattr(ops, name, counting(name, getattr(ops, name)))
    return calls


@pytest.mark.slow
@pytest.mark.gpu
def test_gpt_training_step_with_kernels_equals_the_reference(ops, monkeypatch):
    calls = _count_calls(ops, monkeypatch)
    loss, grads_fused = _gpt_step(True)
    # 2 blocks: 2 GeLUs, 4 bias-dropout-adds, 5 LayerNorms, one loss.
    assert calls == {"bias_gelu": 2, "bias_dropout_add": 4, "layer_norm": 5, "cross_entropy": 1}
    ref_loss, ref_grads = _gpt_step(False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads_fused.items():
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
@pytest.mark.gpu
def test_gpt_bf16_autocast_step_with_kernels_is_close_to_the_reference(ops):
    loss, grads_fused = _gpt_step(True, torch.bfloat16)
    ref_loss, ref_grads = _gpt_step(False, torch.bfloat16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0.0)
    fused = torch.cat([g.flatten() for g in grads_fused.values()])
    ref = torch.cat([ref_grads[n].flatten() for n in grads_fused])
    assert (fused - ref).norm() / ref.norm() < 2e-2


@pytest.mark.slow
@pytest.mark.gpu
def test_dropout_masks_replay_under_full_recomputation(ops):
    loss, grads_full = _gpt_step(True, dropout=0.2, recompute="full")
    ref_loss, ref_grads = _gpt_step(True, dropout=0.2, recompute="none")
    assert loss == ref_loss
    for name, grad in grads_full.items():
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
    no_dropout, _ = _gpt_step(True, recompute="none")
    assert loss != no_dropout  # dropout did act


def _llama_cfg(**kw):
    cfg = dict(
        preset=None, n_layer=2, n_head=4, n_kv_heads=2, d_model=32, seq_len=16,
        ffn_size=48, rope_scaling=4.0, rope_original_seq_len=8, dropout=0.0,
        tie_embeddings=False,
    )  # fmt: skip
    cfg.update(kw)
    return model_config("llama", **cfg)


def _llama_step(fused, precision=torch.float32):
    from hpcllm.model.llama import Llama

    return _model_step(lambda: Llama(_llama_cfg(), 100, seed=3), fused, precision)


@pytest.mark.slow
@pytest.mark.gpu
def test_llama_training_step_with_kernels_equals_the_reference(ops, monkeypatch):
    names = ("rms_norm", "swiglu", "rotary", "bias_dropout_add", "cross_entropy")
    calls = _count_calls(ops, monkeypatch, names)
    kernels.reset_implementations_used()
    loss, grads_fused = _llama_step(True)
    # 2 blocks: 5 RMSNorms (2 a block, the final one), 2 SwiGLUs, q and k rotated in each.
    assert calls == {
        "rms_norm": 5, "swiglu": 2, "rotary": 4, "bias_dropout_add": 4, "cross_entropy": 1
    }  # fmt: skip
    assert {k: v for k, v in kernels.implementations_used().items() if v == "triton"}.keys() >= {
        "rms_norm", "swiglu", "rotary"
    }  # fmt: skip
    ref_loss, ref_grads = _llama_step(False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads_fused.items():
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
@pytest.mark.gpu
def test_every_op_runs_in_an_nvtx_range_named_for_it(ops, monkeypatch):
    # On a GPU each op is an NVTX range "hpcllm.OP" for Nsight Systems; here the predicate is
    # forced on and torch's NVTX call recorded.
    import contextlib

    opened = []

    @contextlib.contextmanager
    def record(name):
        opened.append(name)
        yield

    on_gpu_eagerly = kernels.in_range
    assert not on_gpu_eagerly(torch.ones(1))  # the CPU: no ranges
    monkeypatch.setattr(torch.cuda.nvtx, "range", record)
    monkeypatch.setattr(kernels, "in_range", lambda x: True)
    _llama_step(True)
    _gpt_step(True)
    names = ("rms_norm", "swiglu", "rotary", "bias_dropout_add", "cross_entropy", "bias_gelu",
             "layer_norm")  # fmt: skip
    assert set(opened) == {f"hpcllm.{op}" for op in names}


@pytest.mark.slow
@pytest.mark.gpu
def test_llama_bf16_autocast_step_with_kernels_is_close_to_the_reference(ops):
    loss, grads_fused = _llama_step(True, torch.bfloat16)
    ref_loss, ref_grads = _llama_step(False, torch.bfloat16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0.0)
    fused = torch.cat([g.flatten() for g in grads_fused.values()])
    ref = torch.cat([ref_grads[n].flatten() for n in grads_fused])
    assert (fused - ref).norm() / ref.norm() < 2e-2


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["off", "on", "auto"], ids=["references", "custom-ops", "auto"])
def test_compiled_llama_block_traces_in_one_graph_and_matches_eager(ops, fused):
    """torch.compile(fullgraph=True) of one Llama block (GQA, scaled rope) with the three
    Llama ops: no graph break, one graph for two blocks, eager's outputs and gradients."""
    from hpcllm.model.llama import Llama

    auto = fused == "auto"
    kernels.set_enabled(
        fused != "off",
        choose=auto,
        clock=FakeClock(),
        compiled_reference=auto,
    )
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = _llama_cfg(d_model=64, seq_len=32)
        block = Llama.block(cfg, None, torch.Generator().manual_seed(0)).to(DEVICE)
        x = leaf(torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)))
        kernels.reset_implementations_used()
        out, grads_compiled = _block_step(torch.compile(block, fullgraph=True), x)
        ran = ("rms_norm", "rotary", "swiglu", "bias_dropout_add") if fused == "on" else ()
        assert kernels.implementations_used() == dict.fromkeys(ran, "triton")
        second = Llama.block(cfg, None, torch.Generator().manual_seed(2)).to(DEVICE)
        _block_step(torch.compile(second, fullgraph=True), x)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        ref_out, ref_grads = _block_step(block, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for got, want in zip(grads_compiled, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        kernels.set_enabled(True)


@pytest.mark.slow
def test_bench_smoke_mode_runs_every_op_and_variant(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcllm",
            "bench",
            "kernels",
            "--cpu-smoke",
            "--iters",
            "1",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    every_op = ("bias_gelu", "bias_dropout_add", "layer_norm", "cross_entropy", "rms_norm",
                "swiglu", "rotary")  # fmt: skip
    assert [(r["op"], r["pass"]) for r in result["ops"]] == [
        (op, p) for op in every_op for p in ("fwd", "fwd+bwd")
    ]
    assert all(r["max_error"] < 0.05 and r["triton_ms"] > 0 for r in result["ops"])
    losses = [r["first_loss"] for r in result["training"]]
    assert [r["variant"] for r in result["training"]] == [
        "kernels off",
        "kernels on",
        "kernels auto",
        "torch.compile",
        "torch.compile + kernels",
        "torch.compile + auto",
    ]
    assert max(losses) - min(losses) < 0.05
    triton_ops = {r["variant"]: r["triton_ops"] for r in result["training"]}
    every = ["bias_dropout_add", "bias_gelu", "cross_entropy", "layer_norm"]
    assert triton_ops["kernels on"] == every == triton_ops["torch.compile + kernels"]
    assert triton_ops["kernels off"] == [] == triton_ops["torch.compile"]
    # The whole model compiled: inductor's code, but for the cross-entropy kernel.
    assert triton_ops["torch.compile + auto"] == ["cross_entropy"]
    assert "| cross_entropy | fwd+bwd |" in run.stdout and "| kernels on |" in run.stdout
    for op in ("rms_norm", "swiglu", "rotary"):  # the Llama ops' rows
        assert f"| {op} | fwd |" in run.stdout and f"| {op} | fwd+bwd |" in run.stdout
    # Each row says what auto runs at the op's shape: the faster as its chooser timed them.
    cells = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| tiny")]
    auto_column = {(row[1], row[2]): row[-2] for row in cells}
    named = {"triton": "Triton", "torch": "eager"}
    for r in result["ops"]:
        auto = r["auto_fwd_bwd_ms"]
        assert r["auto"] == ("triton" if auto["triton"] <= auto["torch"] else "torch")
        assert auto_column[(r["op"], r["pass"])] == named[r["auto"]]
    assert "auto: what model.fused_kernels: auto runs at the op's shape" in run.stdout


@pytest.mark.slow
@pytest.mark.gpu
def test_auto_and_bench_kernels_give_the_same_time_for_the_same_op_and_shape(ops):
    """Under one fake clock, the times auto's chooser records for each op at the smoke shape
    are bench kernels' forward + backward times of the Triton op and the eager reference,
    and the auto column is the chooser's pick."""
    from hpcllm.bench import kernels as bench
    from hpcllm.observe import CaseProgress

    clock = FakeClock(triton={"layer_norm": 3.0, "rotary": 3.0})  # Triton slower for two ops
    backend = "inductor" if CUDA else "eager"
    with CaseProgress(len(bench.OPS), "bench kernels", show=False) as progress:
        rows = bench.bench_ops([bench.SMOKE_SIZES], DEVICE, clock, 1.0, backend, progress)
    kernels.set_enabled(True, choose=True, clock=clock)
    try:
        for case in bench._op_cases(bench.SMOKE_SIZES, DEVICE):
            case.call(getattr(kernels, case.name), False)  # the op's first call: auto times it
        timed = {key[0]: times for key, times in kernels.choice_timings().items()}
        chosen = {key[0]: pick for key, pick in kernels.choices().items()}
    finally:
        kernels.set_enabled(True)
    slower = ("layer_norm", "rotary")
    assert chosen == {op: "torch" if op in slower else "triton" for op in bench.OPS}
    for row in rows:
        assert row["auto"] == chosen[row["op"]]
        assert tuple(row["auto_fwd_bwd_ms"].values()) == timed[row["op"]]
        same = (row["triton_ms"], row["eager_ms"]) == timed[row["op"]]
        assert same == (row["pass"] == "fwd+bwd"), row  # the forward alone: another figure


def _custom_op_cases(dtype, with_bias):
    """Return (op, args) for every ``hpcllm`` custom op, forward and backward, on the CPU."""
    gen = torch.Generator().manual_seed(8)

    def rand(*shape, dt=dtype, grad=False):
        return torch.randn(shape, generator=gen).to(dt).requires_grad_(grad)

    h, vocab = 48, 40
    x, residual = rand(2, 5, h, grad=True), rand(2, 5, h, dt=torch.float32, grad=True)
    bias = rand(h, dt=torch.float32, grad=True) if with_bias else None
    w, b = rand(h, dt=torch.float32, grad=True), rand(h, dt=torch.float32, grad=True)
    seed = torch.tensor(1234)
    _, mean, rstd = torch.ops.hpcllm.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    logits = rand(10, 64, grad=True)
    labels = torch.randint(0, vocab, (10,), generator=gen)
    lse = torch.logsumexp(logits.detach().float()[:, :vocab], -1)
    op = torch.ops.hpcllm
    # Backward ops have no derivative of their own: their inputs do not require grad.
    x_, w_, b_ = x.detach(), w.detach(), b.detach()
    bias_ = None if bias is None else bias.detach()
    _, rms_rstd = torch.ops.hpcllm.rms_norm(x.detach(), w.detach(), 1e-6)
    q = rand(2, 5, 3, 8, grad=True)
    inv_freq = torch.tensor([1.0, 0.3, 0.01, 0.0001])
    llama = [
        (op.rms_norm, (x, w, 1e-6)),
        (op.rms_norm_backward, (rand(2, 5, h, dt=torch.float32), x_, w_, rms_rstd)),
        (op.swiglu, (x, rand(2, 5, h, grad=True))),
        (op.swiglu_backward, (rand(2, 5, h), x_, rand(2, 5, h))),
        (op.rotary, (q, inv_freq, None, 3, 1.0)),
        (op.rotary, (q.detach(), inv_freq, None, 0, -1.0)),
        (op.rotary, (q, inv_freq, torch.tensor([4, 0, 0, 9, 2]), 0, 1.0)),
        (op.rotary, (q, inv_freq, torch.tensor([[0, 1, 2, 0, 1], [7, 8, 30, 31, 32]]), 0, 1.0)),
    ]
    return llama + [
        (op.bias_gelu, (x, bias)),
        (op.bias_gelu_backward, (rand(2, 5, h), x_, bias_)),
        (op.bias_dropout_add, (x, bias, residual, 0.3, seed)),
        (op.bias_dropout_add, (x, bias, residual, 0.0, None)),
        (op.bias_dropout_add_backward, (rand(2, 5, h, dt=torch.float32), bias_, 0.3, seed, dtype)),
        (op.layer_norm, (x, w, b, 1e-5)),
        (op.layer_norm_backward, (rand(2, 5, h), x_, w_, b_, mean, rstd)),
        (op.cross_entropy, (logits, labels, vocab)),
        (op.vocab_ce_partials, (logits.detach()[:, 32:], labels, 32, vocab)),
        (op.vocab_ce_backward, (logits.detach(), labels, lse, torch.tensor(0.1), 0, vocab)),
    ]


# The CPU implementations: torch everywhere; the Triton kernels under the interpreter where
# Triton was imported for it (not on a CUDA machine, where it compiles for the GPU).
@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch"] if CUDA else ["interpreter", "torch"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_ops_pass_opcheck(ops, impl, with_bias, dtype, monkeypatch):
    """Schema, fake (meta) implementation, autograd registration and AOT tracing of each op.

    Under ``TRITON_INTERPRET`` the CPU implementation runs the Triton kernels, else torch.
    """
    if impl == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for op, args in _custom_op_cases(dtype, with_bias):
        with_args = ", ".join(type(a).__name__ for a in args)
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), f"{op}({with_args}): {result}"


def _block_step(block, x):
    out = block(x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], torch.ones_like(out))
    return out, grads


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["off", "on", "auto"], ids=["references", "custom-ops", "auto"])
def test_compiled_block_traces_in_one_graph_and_matches_eager(ops, fused):
    """torch.compile(fullgraph=True) of one GPT block: references, or the ``hpcllm`` ops.

    Under auto the compiled block traces the references for inductor to fuse, even where the
    clock would have auto pick Triton for the op called eagerly.
    """
    auto = fused == "auto"
    kernels.set_enabled(
        fused != "off",
        choose=auto,
        clock=FakeClock(),
        compiled_reference=auto,
    )
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = _small(n_head=2, d_model=64, seq_len=32)
        block = GPT.block(cfg, None, torch.Generator().manual_seed(0)).to(DEVICE)
        x = leaf(torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)))
        kernels.reset_implementations_used()
        out, grads_compiled = _block_step(torch.compile(block, fullgraph=True), x)
        # Triton kernels are noted where they run, so inside compiled graphs too; compiled
        # references are the compiler's code and not noted.
        ran = ("layer_norm", "bias_dropout_add", "bias_gelu") if fused == "on" else ()
        assert kernels.implementations_used() == dict.fromkeys(ran, "triton")
        # One block graph: no guard on the dispatch's bookkeeping recompiles a second block.
        second = GPT.block(cfg, None, torch.Generator().manual_seed(2)).to(DEVICE)
        _block_step(torch.compile(second, fullgraph=True), x)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        ref_out, ref_grads = _block_step(block, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for got, want in zip(grads_compiled, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        kernels.set_enabled(True)


@pytest.mark.gpu
@pytest.mark.parametrize("before", [False, True], ids=["bias-in-gemm", "bias-outside"])
def test_compiled_block_under_auto_gives_the_matmuls_their_biases(ops, before):
    """Under auto a compiled block leaves the bias ops to inductor, so each matmul takes its
    bias itself (cuBLAS's epilogue), as plain PyTorch does: every linear of the traced graph
    has its bias. The switch that restores the earlier path leaves the four biases to the
    bias-GeLU and bias-dropout-add references, after bias-free matmuls."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    kernels.set_enabled(True, choose=True, clock=FakeClock(), compiled_reference=True)
    kernels.BIAS_OUTSIDE_GEMM_WHEN_COMPILED = before
    try:
        torch._dynamo.reset()
        block = GPT.block(_small(n_head=2, d_model=64, seq_len=32), None, torch.Generator())
        x = leaf(torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)))
        torch.compile(block.to(DEVICE), backend=keep, fullgraph=True)(x)
    finally:
        kernels.BIAS_OUTSIDE_GEMM_WHEN_COMPILED = False
        kernels.set_enabled(True)
        torch._dynamo.reset()
    (graph,) = graphs
    linears = [n for n in graph.graph.nodes if n.target is torch._C._nn.linear]
    with_bias = [len(n.args) > 2 and n.args[2] is not None for n in linears]
    assert len(linears) == 4  # qkv, attention output, fc, MLP output
    assert with_bias == [True, False, False, False] if before else [True] * 4


@pytest.mark.gpu
def test_custom_op_dropout_mask_is_a_function_of_its_seed(ops):
    """Same seed: same mask, forward and backward; another seed: another mask."""
    gen = torch.Generator().manual_seed(9)
    x = leaf(torch.rand(64, 300, generator=gen) + 1.0)  # never 0: kept elements change
    residual = leaf(torch.zeros(64, 300))
    p = 0.2

    def run(seed):
        out = torch.ops.hpcllm.bias_dropout_add(x, None, residual, p, dev(torch.tensor(seed)))
        (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
        return out != 0, dx

    kept, dx = run(5)
    again, dx_again = run(5)
    assert torch.equal(kept, again) and torch.equal(dx, dx_again)
    assert torch.equal(dx, kept.float() / (1 - p))  # backward regenerates the forward mask
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / kept.numel()) ** 0.5
    other, _ = run(6)
    assert abs((kept & other).float().mean().item() - (1 - p) ** 2) < 0.02
    # The dispatch draws the seed from torch's CPU generator: manual_seed replays it.
    torch.manual_seed(3)
    first = kernels.bias_dropout_add(x, None, residual, p, True)
    torch.manual_seed(3)
    assert torch.equal(kernels.bias_dropout_add(x, None, residual, p, True), first)


@pytest.mark.gpu
def test_auto_times_each_signature_once_and_runs_the_faster(ops):
    # Triton faster for bias_gelu and bias_dropout_add (1 against 2), slower for layer_norm.
    clock = FakeClock(triton={"layer_norm": 3.0})
    timed = clock.timed  # each run: forward and backward of copies of the arguments
    kernels.set_enabled(True, choose=True, clock=clock)
    try:
        assert kernels.choosing()
        gen = torch.Generator().manual_seed(10)
        x, bias = leaf(torch.randn(4, 32, generator=gen)), leaf(torch.randn(32, generator=gen))
        kernels.reset_implementations_used()
        y = kernels.bias_gelu(x, bias)
        assert timed == ["bias_gelu", "torch"]
        assert kernels.implementations_used() == {"bias_gelu": "triton"}
        assert "hpcllm_bias_gelu" in y.grad_fn.name() and x.grad is None and bias.grad is None
        kernels.bias_gelu(x, bias)
        assert len(timed) == 2  # cached
        kernels.bias_gelu(x, None)  # another signature: no bias
        kernels.bias_gelu(x.detach().to(torch.bfloat16), bias)  # another dtype
        kernels.bias_gelu(leaf(torch.randn(5, 32, generator=gen)), bias)  # another shape
        assert len(timed) == 8
        assert set(kernels.choices().values()) == {"triton"} and len(kernels.choices()) == 4
        assert (
            "bias_gelu",
            ((4, 32), torch.float32, DEVICE.type),
            ((32,), torch.float32, DEVICE.type),
        ) in kernels.choices()

        w, b = leaf(torch.randn(32, generator=gen)), leaf(torch.randn(32, generator=gen))
        y = kernels.layer_norm(x, w, b, 1e-5)
        assert timed[-2:] == ["layer_norm", "torch"]
        assert kernels.implementations_used()["layer_norm"] == "torch"
        assert "hpcllm" not in y.grad_fn.name()
        ref = reference.layer_norm(x, w, b, 1e-5)
        close(y, ref)
        close(grads(y, x, torch.ones_like(y))[0], grads(ref, x, torch.ones_like(ref))[0])
        kernels.layer_norm(x, w, b, 1e-5)
        assert len(timed) == 10 and kernels.implementations_used()["layer_norm"] == "torch"

        # Timing draws no random numbers the next dropout would have drawn.
        torch.manual_seed(4)
        kernels.set_enabled(True)
        residual = leaf(torch.randn(4, 32, generator=gen))
        want = kernels.bias_dropout_add(x, bias, residual, 0.5, True)
        kernels.set_enabled(True, choose=True, clock=clock)
        assert kernels.choices() == {}  # forgotten
        torch.manual_seed(4)
        assert torch.equal(kernels.bias_dropout_add(x, bias, residual, 0.5, True), want)
    finally:
        kernels.set_enabled(True)
    assert not kernels.choosing()


@pytest.mark.gpu
def test_disabled_runs_the_references_and_keeps_auto_choices(ops):
    x = leaf(torch.randn(4, 8))
    kernels.set_enabled(True, choose=True, clock=FakeClock())
    try:
        kernels.bias_gelu(x, None)
        chosen = kernels.choices()
        assert list(chosen.values()) == ["triton"]
        with kernels.disabled():
            assert not kernels.enabled()
            assert "hpcllm" not in kernels.bias_gelu(x, None).grad_fn.name()
        assert kernels.enabled() and kernels.choosing() and kernels.choices() == chosen
    finally:
        kernels.set_enabled(True)
