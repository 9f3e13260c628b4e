"""Each parameter's role: what the gradient sums, the optimizers, the norm, the parameter
count and re-cut need to know of it, in one place.

A model's parameters carry a :class:`TensorRole` (``param.role``), made by :func:`assign_roles`
from the family's tensor rules (:class:`hpcllm.families.TensorRule`) and the layout the model
is built at (t, this rank's tp rank, sequence parallelism); the stage cut adds a tied tensor's
role (:func:`tie_across_stages`). Nothing else marks a parameter, and no consumer asks which
module or family a parameter came from.

A role's ``sums`` name the gradient kinds that make its gradient whole beyond the
data-parallel mean (:data:`GRADIENT_KINDS`); :mod:`hpcllm.parallel.data.finalize` runs one sum
per kind. The set is open: a tensor sharded over another axis and reduced over that axis's own
group is one more kind, named by the rules of the tensors it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from hpcllm.families import Family, TensorRule


@dataclass(frozen=True)
class GradientKind:
    """A sum that completes some parameters' gradients: over which process group (a member of
    :class:`hpcllm.topology.ProcessGroups`), and at which layouts it is needed."""

    name: str
    group: str
    sequence_parallel_only: bool = False  # needed only under sequence parallelism
    replicated_only: bool = False  # needed only where several tp ranks hold one slice
    tp_only: bool = False  # needed only where t > 1


# By name, as TensorRule.grad and the stage cut name them; "local" needs no sum.
GRADIENT_KINDS: dict[str, GradientKind] = {
    kind.name: kind
    for kind in (
        # Whole on every tp rank but, under sequence parallelism, fed 1/t of the tokens.
        GradientKind("tp-sum-if-sequence-parallel", "tp", sequence_parallel_only=True),
        # Whole on every tp rank but applied to each rank's own heads (Qwen3's q and k norms).
        GradientKind("tp-sum", "tp", tp_only=True),
        # A key/value head kept on the t / heads ranks whose queries use it.
        GradientKind("kv-replicas", "tp", replicated_only=True),
        # The copies of a tensor tied across the first and the last stage.
        GradientKind("tied", "embedding"),
    )
}


@dataclass(frozen=True)
class TensorRole:
    """What one parameter is on this rank (the default: whole everywhere, nothing to sum)."""

    split: tuple[int, int] | None = None  # (dim, stride) of its tp slice; None: whole
    replicas: int = 1  # tp ranks that hold the same slice
    replica: int = 0  # which of them this rank is; the first (0) counts it
    padded: bool = False  # its rows are the vocabulary, padded to a multiple of 128·t
    sums: tuple[str, ...] = field(default=())  # GRADIENT_KINDS its gradient takes
    stage_copy: bool = False  # the last stage's copy of a tied tensor: the first counts it
    experts: int = 1  # ep ranks that split it by expert (dim 0); its gradient averages over
    # the expert-data-parallel group and its norm sums over the ep group

    @property
    def counted(self) -> bool:
        """Return whether this rank counts the tensor in the gradient norm (once per model)."""
        return not self.stage_copy and self.replica == 0

    def whole_numel(self, numel: int, t: int) -> int:
        """Return the elements of the whole tensor this rank's ``numel`` stand for: a slice
        times the distinct slices over t ranks (and over the ep ranks for experts), a whole
        tensor once."""
        numel *= self.experts
        return numel * (t // self.replicas) if self.split is not None else numel


def role(param: torch.Tensor) -> TensorRole:
    """Return ``param``'s role (the default role where none was assigned)."""
    return getattr(param, "role", None) or TensorRole()


def replicas(grad_kind: str, t: int, kv_heads: int) -> int:
    """Return how many of t tp ranks hold each slice of a tensor whose gradient kind is
    ``grad_kind``: t / heads for a key/value projection with fewer heads than ranks, else 1."""
    return max(1, t // kv_heads) if grad_kind == "kv-replicas" else 1


def assign_roles(
    named: Iterable[tuple[str, nn.Parameter]],
    family: Family,
    *,
    t: int,
    tp_rank: int,
    sequence_parallel: bool,
    kv_heads: int,
    buffers: Iterable[tuple[str, torch.Tensor]] = (),
    ep: int = 1,
) -> None:
    """Give each parameter (by whole-model name) the role its family's rule says at this
    layout; a ValueError where a rule's split is not the one its layer made
    (``param.partition``, which the tensor-parallel layers set).

    ``ep``: the expert-parallel size the routed experts are split over (their rules' ``experts``).

    ``buffers``: the persistent buffers (:func:`persistent_buffers`), which a checkpoint
    saves and the re-cut cuts by their rule: checked the same way, given no role (a buffer is
    a new tensor after a move or a cast, which would drop it).
    """
    for name, buffer in buffers:
        _checked_rule(family, name, buffer)
    for name, param in named:
        rule = _checked_rule(family, name, param)
        count = replicas(rule.grad, t, kv_heads)
        kind = GRADIENT_KINDS.get(rule.grad)
        needed = kind is not None and not (
            (kind.sequence_parallel_only and not (sequence_parallel and t > 1))
            or (kind.replicated_only and count == 1)
            or (kind.tp_only and t == 1)
        )
        param.role = TensorRole(
            split=rule.split,
            replicas=count,
            replica=tp_rank % count,
            padded=rule.padded,
            sums=(rule.grad,) if needed else (),
            experts=ep if rule.experts else 1,
        )


def _checked_rule(family: Family, name: str, tensor: torch.Tensor) -> TensorRule:
    rule = family.rule(name)
    made = getattr(tensor, "partition", None)
    if rule.split != (made[:2] if made else None):
        raise ValueError(
            f"family {family.name}: the rule of {name} splits it as {rule.split}, its "
            f"layer as {made}"
        )
    return rule


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Return the buffers ``module``'s state_dict holds (the persistent ones), by name."""
    params = {name for name, _ in module.named_parameters()}
    return [(n, t) for n, t in module.state_dict(keep_vars=True).items() if n not in params]


def tie_across_stages(param: nn.Parameter, stage_copy: bool) -> None:
    """Add the tied sum to a tensor held by the first and the last stage; ``stage_copy``:
    this is the last stage's copy, which the first stage counts."""
    now = role(param)
    param.role = replace(now, sums=(*now.sums, "tied"), stage_copy=stage_copy)
