"""Under mpirun with t ranks: the MoE layer split over t (with and without sequence
parallelism) against the same layer in one process, built from the same generator.

Prints one JSON line per rank with the largest relative differences of the output, the input
gradient, the router's gradient (summed over t under sequence parallelism, as the step does)
and this rank's slices of the experts' gradients, and the logged balancing and z losses.
"""

import json
import sys

import torch

from hpcllm import topology
from hpcllm.model.moe import MoE, take_aux_losses
from hpcllm.parallel.tensor.layers import shard_of

B, S, H, E, FFN = 2, 8, 16, 4, 32


def layer(group, sp: bool, activation: str, capacity) -> MoE:
    m = MoE(
        H,
        E,
        2,
        FFN,
        activation=activation,
        group=group,
        gen=torch.Generator().manual_seed(7),
        init_std=0.3,
        out_std=0.2,
        capacity_factor=capacity,
        aux_loss=0.1,
        z_loss=0.01,
        sequence_parallel=sp,
        shared_ffn=8,
        shared_gate=activation == "swiglu",
    )
    if activation == "gelu":
        with torch.no_grad():
            gen = torch.Generator().manual_seed(8)
            m.experts.proj_bias.normal_(0, 0.2, generator=gen)
            m.shared.proj_bias.normal_(0, 0.2, generator=gen)
    return m


def backward(layer: MoE, loss: torch.Tensor, scale: float) -> None:
    """Backpropagate ``loss`` and the layer's auxiliary losses at ``scale``, as the step does."""
    aux = take_aux_losses([layer])
    torch.autograd.backward([loss, aux], [None, torch.tensor(scale)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(grid, sp: bool, activation: str, capacity) -> dict:
    t, rank, group = grid.tp, grid.tp_rank, grid.groups.tp
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))

    serial = layer(None, False, activation, capacity)
    xs = x.clone().requires_grad_()
    ys, _ = serial(xs)
    backward(serial, 0.5 * (ys * dy).sum(), 0.5)

    par = layer(group, sp, activation, capacity)
    part = slice(rank * S // t, (rank + 1) * S // t) if sp else slice(None)
    xp = x[:, part].clone().requires_grad_()
    yp, _ = par(xp)
    backward(par, 0.5 * (yp * dy[:, part]).sum(), 0.5)
    router_grad = par.router.weight.grad.clone()
    if sp:  # the step's sum of the sequence-parallel gradients
        torch.distributed.all_reduce(router_grad, group=group)

    experts = {}
    wholes = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        if name == "router.weight":
            continue
        whole = wholes[name].grad
        split = getattr(p, "partition", None)
        want = shard_of(whole, split[0], 1, rank, t) if split else whole
        got = p.grad.clone()
        if sp and not split:  # a whole tensor fed this rank's tokens: summed over t
            torch.distributed.all_reduce(got, group=group)
        experts[name] = rel(got, want)
    return {
        "out": rel(yp, ys[:, part]),
        "input_grad": rel(xp.grad, xs.grad[:, part]),
        "router_grad": rel(router_grad, serial.router.weight.grad),
        "experts": experts,
        "balance": [par.stats.balance.item(), serial.stats.balance.item()],
        "z": [par.stats.z.item(), serial.stats.z.item()],
        "counts": [par.stats.counts.tolist(), serial.stats.counts.tolist()],
    }


def main() -> None:
    grid = topology.init(tp=int(sys.argv[1]))
    out = {}
    for sp in (False, True):
        for activation in ("swiglu", "gelu"):
            for capacity in (None, 1.0):
                out[f"sp={sp},{activation},c={capacity}"] = run(grid, sp, activation, capacity)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
