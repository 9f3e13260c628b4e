"""Device code of the fused ops: the Triton kernels that :mod:`hpcllm.kernels.triton_ops` launches.

Every kernel loads its inputs in their storage dtype (fp32, bf16 or fp16), computes in fp32
and stores in the output's dtype. Reductions over rows (bias, LayerNorm weight and bias
gradients) are two-stage and persistent: a backward kernel launches a few programs per SM
(:mod:`~hpcllm.kernels.triton_ops` sizes the grid), each walks the rows with a stride of the
program count and keeps its fp32 partial sums in registers, so the partial-sum buffer has a
few rows per SM rather than one per tile, and the host adds those few rows up.

Importing this module imports Triton; whether the kernels compile for the GPU or run in
Triton's interpreter is fixed when it is imported (``TRITON_INTERPRET=1``).
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

import triton
import triton.language as tl


@triton.jit
def _tile(pid_r, pid_c, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Return (column indices, flat offsets, mask) of tile (pid_r, pid_c) of a row-major matrix.

    ``tl.cast``, not ``.to``: a loop variable is a Python int in the interpreter.
    """
    rows = tl.cast(pid_r, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs = rows[:, None] * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return cols, offs, mask


@triton.jit
def _gelu_sigmoid(z):
    """Return sigmoid(2u), u = sqrt(2/pi)(z + 0.044715 z^3): GeLU_tanh(z) = z * sigmoid(2u).

    The constants are literals: Triton 3.9's interpreter breaks on a global constexpr times a
    block. Clamping 2u leaves sigmoid exactly 0 or 1 in fp32 and keeps exp finite.
    """
    two_u = 1.5957691216057308 * (z + 0.044715 * z * z * z)
    return tl.sigmoid(tl.minimum(tl.maximum(two_u, -80.0), 80.0))


@triton.jit
def bias_gelu_fwd(
    x_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_cols,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, offs, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = z * _gelu_sigmoid(z)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_bwd(
    dy_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    part_ptr,
    n_rows,
    n_cols,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Persistent: program (r, c) takes row tiles r, r + R, r + 2R, ... of column tile c."""
    pid_r, pid_c, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for tile in range(pid_r, tl.cdiv(n_rows, BLOCK_R), programs):
        cols, offs, mask = _tile(tile, pid_c, n_rows, n_cols, BLOCK_R, BLOCK_C)
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = _gelu_sigmoid(z)
        # d/dz [z * sigmoid(2u)] = s + 2 z s (1 - s) u'(z),
        # 2u' = 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2); masked lanes have dy = 0.
        dz = dy * (s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z))
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dz
    if HAS_BIAS:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(
            part_ptr + pid_r.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols
        )


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: no recompiles
def bias_dropout_add_fwd(
    x_ptr,
    b_ptr,
    r_ptr,
    out_ptr,
    n_rows,
    n_cols,
    p,
    scale,
    seed,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, offs, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        # The element's flat index is its Philox counter: backward regenerates the same mask.
        z = tl.where(tl.rand(seed, offs) >= p, z * scale, 0.0)
    out = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32) + z
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])  # a new seed every call: no recompiles
def bias_dropout_add_bwd(
    dy_ptr,
    dx_ptr,
    part_ptr,
    n_rows,
    n_cols,
    p,
    scale,
    seed,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Persistent, as :func:`bias_gelu_bwd`; the mask is regenerated from (seed, index)."""
    pid_r, pid_c, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for tile in range(pid_r, tl.cdiv(n_rows, BLOCK_R), programs):
        cols, offs, mask = _tile(tile, pid_c, n_rows, n_cols, BLOCK_R, BLOCK_C)
        dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            dz = tl.where(tl.rand(seed, offs) >= p, dz * scale, 0.0)
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dz
    if HAS_BIAS:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(
            part_ptr + pid_r.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols
        )


@triton.jit
def layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    # Two passes over the row in registers: no cancellation from E[x^2] - E[x]^2.
    centred = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * n_cols + cols,
        (centred * rstd * w + b).to(y_ptr.dtype.element_ty),
        mask=inside,
    )
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    BLOCK: tl.constexpr,
):
    """Persistent: program i takes rows i, i + P, i + 2P, ... and writes one partial row."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        start = tl.cast(row, tl.int64) * n_cols  # row: a Python int in the interpreter
        x = tl.load(x_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(inside, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # dx = rstd (w dy - mean(w dy) - xhat mean(xhat w dy))
        dx = rstd * (
            wdy - tl.sum(wdy, axis=0) / n_cols - xhat * (tl.sum(xhat * wdy, axis=0) / n_cols)
        )
        tl.store(dx_ptr + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=inside)
    tl.store(db_part_ptr + pid.to(tl.int64) * n_cols + cols, db, mask=inside)


@triton.jit
def ce_partials(
    x_ptr,
    labels_ptr,
    max_ptr,
    sumexp_ptr,
    target_ptr,
    row_stride,
    n_local,
    vocab_start,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """Per row of a vocabulary slice: max, sum of exp(x - max), and the label's logit.

    One pass over the row keeps a running max and a sum rescaled whenever the max grows
    (per lane; the lanes are merged at the end). Columns at or past ``vocab_size`` are padding
    and take no part. A slice with no real column gives max -inf and sum 0.
    """
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    local = tl.load(labels_ptr + row) - vocab_start
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # The label's logit is picked up on the way (a masked scalar load would be the direct
    # route, but the interpreter rejects those); rows whose label is elsewhere get 0.
    hit = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_local, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = (cols < n_local) & (vocab_start + cols < vocab_size)
        x = tl.load(base + cols, mask=real, other=float("-inf")).to(tl.float32)
        hit += tl.where((cols == local) & real, x, 0.0)
        new_top = tl.maximum(top, x)
        # Lanes that have seen only padding keep max -inf; shift them by 0, not by -inf.
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        acc = acc * tl.exp(top - shift) + tl.exp(x - shift)
        top = new_top
    row_max = tl.max(top, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, tl.sum(acc * tl.exp(top - shift), axis=0))
    tl.store(target_ptr + row, tl.sum(hit, axis=0))


@triton.jit
def ce_backward(
    x_ptr,
    labels_ptr,
    lse_ptr,
    g_ptr,
    dx_ptr,
    row_stride,
    g_stride,
    n_local,
    vocab_start,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """Write (exp(x - lse) - onehot(label)) * g for one row of a vocabulary slice; 0 on padding."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row * g_stride).to(tl.float32)
    local = tl.load(labels_ptr + row) - vocab_start
    for start in range(0, n_local, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_local
        real = inside & (vocab_start + cols < vocab_size)
        x = tl.load(x_ptr + row * row_stride + cols, mask=real, other=float("-inf"))
        grad = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == local, 1.0, 0.0)
        grad = tl.where(real, grad * g, 0.0)
        tl.store(dx_ptr + row * n_local + cols, grad.to(dx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """One row per program: rstd = 1/sqrt(mean(x²) + eps) in fp32; y = w · (x·rstd rounded to
    x's dtype), as the reference rounds the normalised row before the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    raw = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0)
    x = raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, BLOCK: tl.constexpr
):
    """Persistent: program i takes rows i, i + P, ... and writes one partial row of dw.

    With n = x·rstd: dx = rstd (w dy - n mean(n w dy)), dw = Σ dy n (n rounded as forward)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        start = tl.cast(row, tl.int64) * n_cols  # row: a Python int in the interpreter
        raw = tl.load(x_ptr + start + cols, mask=inside, other=0.0)
        x = raw.to(tl.float32)
        dy = tl.load(dy_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        n = x * rstd
        wdy = w * dy
        dx = rstd * (wdy - n * (tl.sum(n * wdy, axis=0) / n_cols))
        tl.store(dx_ptr + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * n.to(raw.dtype).to(tl.float32)
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=inside)


@triton.jit
def swiglu_fwd(g_ptr, u_ptr, y_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = SiLU(g) · u = g · sigmoid(g) · u."""
    _, offs, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    n_rows,
    n_cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dg = dy · u · σ(g) (1 + g (1 - σ(g))), du = dy · g σ(g); SiLU recomputed from g."""
    _, offs, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(
        dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask
    )
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_fwd(
    x_ptr,
    f_ptr,
    y_ptr,
    n_rows,
    heads,
    seq,
    offset,
    sign,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rows of a (b, s, heads, d) tensor, d = 2·HALF: each half of a head pairs with the other
    (Hugging Face's convention). Row r is at position (r // heads) mod s + offset; its angles
    are position × inv_freq in fp32. y1 = x1 cos - x2 sin·sign, y2 = x2 cos + x1 sin·sign:
    sign -1 rotates back (the backward)."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    position = ((rows // heads) % seq + offset).to(tl.float32)
    freq = tl.load(f_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    angle = position[:, None] * freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle) * sign
    first = rows[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + first, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + first + HALF, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)
