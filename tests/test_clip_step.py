"""The optimizer step's clipping: a fused AdamW clips inside its own kernel (``grad_scale``),
and steps as a separate clipping pass followed by the step would."""

from __future__ import annotations

import pytest
import torch

from hpcllm.parallel.data import optimizer as mp
from hpcllm.parallel.data.finalize import clip_divisor
from hpcllm.topology import ProcessGroups

NO_GROUPS = ProcessGroups(None, None, None, None)  # one process: the norm spans no group


def _stepped(clip: float, in_step: bool, scale: float, fused: bool = True) -> tuple:
    """Return (weights after three steps, norms, skipped) of a small model at ``clip``."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(17, 5)), torch.nn.Parameter(torch.randn(5))]
    grads = [[torch.randn_like(w) * scale for w in weights] for _ in range(3)]
    inner = torch.optim.AdamW(weights, lr=1e-2, fused=fused or None, foreach=None)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt = mp.MixedPrecisionOptimizer(inner, scaler, clip, NO_GROUPS)
    was, mp.CLIP_IN_FUSED_STEP = mp.CLIP_IN_FUSED_STEP, in_step
    norms, skipped = [], []
    try:
        for step in grads:
            for w, g in zip(weights, step, strict=True):
                w.grad = g.clone()
            norm, bad = opt.step()
            norms.append(norm.item())
            skipped.append(bool(bad))
            assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")
            opt.zero_grad()
    finally:
        mp.CLIP_IN_FUSED_STEP = was
    return [w.detach().clone() for w in weights], norms, skipped


@pytest.mark.parametrize("scale", [100.0, 1e-3])  # clipped, and below the bound
def test_the_fused_step_clips_as_a_separate_pass_would(scale: float) -> None:
    inside, norms, _ = _stepped(1.0, True, scale)
    outside, norms_outside, _ = _stepped(1.0, False, scale)
    unfused, _, _ = _stepped(1.0, True, scale, fused=False)
    assert norms == norms_outside
    for a, b, c in zip(inside, outside, unfused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    # And clipping changed the update where the norm was over the bound.
    unclipped, _, _ = _stepped(0.0, True, scale)
    pairs = zip(inside, unclipped, strict=True)
    differs = any(not torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in pairs)
    assert differs == (scale > 1.0)


def test_clip_divisor_is_one_under_the_bound_and_not_finite_for_a_bad_norm() -> None:
    assert clip_divisor(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_divisor(torch.tensor(4.0), 2.0).item() == pytest.approx(2.0)
    assert not torch.isfinite(clip_divisor(torch.tensor(float("inf")), 1.0))
    assert torch.isnan(clip_divisor(torch.tensor(float("nan")), 1.0))


def test_a_step_whose_norm_is_not_finite_is_skipped_with_the_clip_inside() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    before = w.detach().clone()
    inner = torch.optim.AdamW([w], lr=1e-2, fused=True)
    opt = mp.MixedPrecisionOptimizer(
        inner, torch.amp.GradScaler("cpu", enabled=False), 1.0, NO_GROUPS
    )
    w.grad = torch.full_like(w, float("nan"))
    _, bad = opt.step()
    assert bool(bad) and torch.equal(w.detach(), before)
