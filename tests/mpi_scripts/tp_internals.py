"""Under mpirun with t ranks: the dropout streams, the communication and the memory of t > 1.

Prints one JSON line per rank, which tests/test_tensor_parallel.py checks:

- ``rng``: whether draws outside the tensor-parallel stream agree across tp ranks and draws
  inside it differ, and whether the default stream continues unchanged after it;
- ``replicated_equal``: with dropout on and no sequence parallelism, the residual stream
  (replicated across tp) is identical on every tp rank;
- ``sp_masks_differ``: under sequence parallelism the ranks' dropout masks differ;
- ``recompute``: largest relative difference of loss and gradients between no recomputation
  and full / selective recomputation, with dropout on (the masks must be replayed);
- ``comm``: tp bytes of one block's forward and backward, by collective;
- ``params``: this rank's transformer-block parameters and the serial model's;
- ``saved``: bytes one block saves for backward, in all and in the regions between tp layers.
"""

import json
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from hpcllm import topology
from hpcllm.config import ModelConfig
from hpcllm.model.gpt import GPT
from hpcllm.parallel.data.finalize import reduce_whole_grads_over_tp
from hpcllm.parallel.random import seed_streams, tp_rng
from hpcllm.parallel.tensor.mappings import count_comm

# TP_SHAPE=b,s,h,heads measures another shape (docs/benchmarks.md uses GPT-2 small's).
B, S, H, HEADS = (int(v) for v in os.environ.get("TP_SHAPE", "2,32,64,4").split(","))
VOCAB = 300


def gathered(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def all_equal(parts: list[torch.Tensor]) -> bool:
    return all(torch.equal(parts[0], p) for p in parts[1:])


def all_different(parts: list[torch.Tensor]) -> bool:
    return all(
        not torch.equal(parts[i], parts[j])
        for i in range(len(parts))
        for j in range(i + 1, len(parts))
    )


def rng_checks(grid) -> dict:
    seed_streams(42, grid.tp_rank)
    before = torch.rand(16)
    with tp_rng(grid.groups.tp):
        inside = torch.rand(16)
    after = torch.rand(16)
    seed_streams(42, grid.tp_rank)
    reference = torch.rand(32)  # the default stream with no tp draw in between
    return {
        "outside_equal": all_equal(gathered(before, grid.groups.tp))
        and all_equal(gathered(after, grid.groups.tp)),
        "inside_differ": all_different(gathered(inside, grid.groups.tp)),
        "default_undisturbed": torch.equal(torch.cat([before, after]), reference),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def recompute_checks(grid, cfg: ModelConfig, sp: bool, ids, labels) -> dict:
    """Loss and grads with recomputation against none, dropout on, same streams."""
    results = {}
    for mode in ("none", "full", "selective"):
        model = GPT(
            replace(cfg, recompute=mode),
            VOCAB,
            seed=3,
            tp_group=grid.groups.tp,
            sequence_parallel=sp,
        )
        seed_streams(9, grid.tp_rank)
        loss = model(ids, labels)
        loss.backward()
        reduce_whole_grads_over_tp(model.parameters(), grid.groups.tp)
        results[mode] = (loss.detach(), [p.grad for p in model.parameters()])
    loss0, grads0 = results["none"]
    return {
        mode: max([rel(loss, loss0)] + [rel(g, g0) for g, g0 in zip(grads, grads0, strict=True)])
        for mode, (loss, grads) in results.items()
        if mode != "none"
    }


def block_comm(grid, cfg: ModelConfig, sp: bool) -> dict:
    block = GPT.block(cfg, grid.groups.tp, torch.Generator().manual_seed(1), sp)
    s = S // grid.tp if sp else S
    x = torch.randn(B, s, H, requires_grad=True)
    with count_comm() as log:
        block(x).sum().backward()
    return {
        f"{op}_{direction}": log.total(op, direction)
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for direction in ("forward", "backward")
    }


def saved_bytes(grid, cfg: ModelConfig, sp: bool) -> dict:
    """Bytes one block keeps for backward (each storage once): in all, and in the regions
    between tensor-parallel layers (LayerNorms, dropout-residual adds, and the LayerNorm
    outputs the column-parallel layers keep as their inputs)."""
    block = GPT.block(cfg, grid.groups.tp, torch.Generator().manual_seed(1), sp)
    params = {p.data_ptr() for p in block.parameters()}
    s = S // grid.tp if sp else S
    x = torch.randn(B, s, H, requires_grad=True)
    where = ["region"]
    for module, label in (
        (block.attn, "tp"),
        (block.mlp, "tp"),
        (block.attn.qkv, "region"),
        (block.mlp.fc, "region"),
        (block.attn.proj, "tp"),
        (block.mlp.proj, "tp"),
    ):
        module.register_forward_pre_hook(lambda *_, label=label: where.append(label))
        module.register_forward_hook(lambda *_: where.pop() and None)
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.data_ptr():
            seen.setdefault(ptr, (t.untyped_storage().nbytes(), where[-1]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return {
        "total": sum(n for n, _ in seen.values()),
        "region": sum(n for n, label in seen.values() if label == "region"),
    }


def main() -> None:
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    grid = topology.init(tp=world)
    cfg = ModelConfig(preset=None, n_layer=2, n_head=HEADS, d_model=H, seq_len=S, dropout=0.1)
    out = {"rank": grid.rank, "tp": grid.tp, "rng": rng_checks(grid)}

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    labels = torch.randint(0, VOCAB, (B, S), generator=gen)

    # Replicated residual stream: identical on every tp rank, dropout included.
    model = GPT(cfg, VOCAB, seed=3, tp_group=grid.groups.tp)
    seed_streams(9, grid.tp_rank)
    hidden = model.run_blocks(model.embed(ids)).detach()
    out["replicated_equal"] = all_equal(gathered(hidden, grid.groups.tp))
    out["replicated_dropped"] = not torch.equal(
        hidden, model.eval().run_blocks(model.embed(ids)).detach()
    )

    # Sequence-parallel regions: each rank draws its own masks (p = 0.5 so they show).
    sp_model = GPT(
        replace(cfg, dropout=0.5), VOCAB, seed=3, tp_group=grid.groups.tp, sequence_parallel=True
    )
    seed_streams(9, grid.tp_rank)
    same_ids = ids[:, :1].expand(B, S).contiguous()  # equal tokens, so only masks differ...
    embedded = sp_model.embed(same_ids)
    clean = sp_model.eval().embed(same_ids)
    # ...but positions differ per rank, so compare where each rank dropped, not the values.
    out["sp_masks_differ"] = all_different(gathered((embedded == 0) & (clean != 0), grid.groups.tp))

    out["recompute"] = {
        "tp": recompute_checks(grid, cfg, False, ids, labels),
        "tp+sp": recompute_checks(grid, cfg, True, ids, labels),
    }
    out["comm"] = {"tp": block_comm(grid, cfg, False), "tp+sp": block_comm(grid, cfg, True)}
    serial_block = GPT.block(cfg, None, torch.Generator().manual_seed(1))
    out["params"] = {
        "rank": sum(
            p.numel() for p in GPT.block(cfg, grid.groups.tp, torch.Generator()).parameters()
        ),
        "serial": sum(p.numel() for p in serial_block.parameters()),
    }
    out["saved"] = {"tp": saved_bytes(grid, cfg, False), "tp+sp": saved_bytes(grid, cfg, True)}
    print(json.dumps(out), flush=True)
    topology.shutdown()


if __name__ == "__main__":
    main()
