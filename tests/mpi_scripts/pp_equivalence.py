"""Under mpirun: pipelined GPT steps against one process on the same global batch.

Usage: mpirun -np N python pp_equivalence.py tp=T pp=P [engines=ddp,horovod] [sg=0,1] [sp]
       [schedules=gpipe,1f1b,interleaved,zb-h1] [microbatches=4,8]

For every schedule, micro-batch count, engine and scatter/gather setting, the rank's chunks
(built from the same seed as the serial GPT) run one step through the pipeline runtime; the
script prints one JSON line per case with the largest relative differences, against the
serial model on the whole global batch, of the loss, every parameter's gradient (this rank's
shard of it) and the global gradient norm, plus the bytes this rank sent between stages.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from hpcllm import topology
from hpcllm.config import ModelConfig, load_config
from hpcllm.model.gpt import GPT
from hpcllm.model.stages import build_chunks
from hpcllm.parallel.data.builder import build_engine
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.finalize import clip_grad_norm
from hpcllm.parallel.pipeline.runtime import Channel, Runtime
from hpcllm.parallel.pipeline.schedule import rank_actions
from hpcllm.parallel.tensor.layers import shard_of
from hpcllm.train.optim import build_optimizer, build_scaler
from hpcllm.train.stage_work import ChunkWork

VOCAB, SEQ, MICRO = 250, 16, 2
SPLIT = {
    "wte.weight": (0, 1),
    "attn.qkv.weight": (0, 3),
    "attn.qkv.bias": (0, 3),
    "attn.proj.weight": (1, 1),
    "mlp.fc.weight": (0, 1),
    "mlp.fc.bias": (0, 1),
    "mlp.proj.weight": (1, 1),
}


def expected_shard(name: str, full: torch.Tensor, grid, padded: int) -> torch.Tensor:
    if name == "wte.weight":
        full = torch.cat([full[:VOCAB], full.new_zeros(padded - VOCAB, full.shape[1])])
    for suffix, how in SPLIT.items():
        if name.endswith(suffix):
            return shard_of(full, *how, grid.tp_rank, grid.tp)
    return full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def global_batch(m: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(77)
    tokens = torch.randint(0, VOCAB, (m * MICRO * d, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    args = dict(a.split("=") if "=" in a else (a, "1") for a in sys.argv[1:])
    tp, pp = int(args.get("tp", 1)), int(args.get("pp", 1))
    engines = args.get("engines", "none").split(",")
    sgs = [bool(int(x)) for x in args.get("sg", "1").split(",")]
    sp = "sp" in args
    schedules = args.get("schedules", "gpipe,1f1b,interleaved,zb-h1").split(",")
    counts = [int(x) for x in args.get("microbatches", "4,8").split(",")]
    grid = topology.init(tp=tp, pp=pp)
    d = grid.dp
    cfg = ModelConfig(preset=None, n_layer=8, n_head=4, d_model=32, seq_len=SEQ)
    serial = GPT(cfg, VOCAB, seed=11)
    parallel_cfg = load_config(None, []).parallel
    train_cfg = load_config(None, []).train
    for schedule in schedules:
        v = 2 if schedule == "interleaved" else 1
        for m in counts:
            ids, labels = global_batch(m, d)
            serial.zero_grad()
            serial_loss = serial(ids, labels)
            serial_loss.backward()
            serial_grads = {n: p.grad for n, p in serial.named_parameters()}
            serial_norm = clip_grad_norm(list(serial.parameters()), 0.0)
            # This replica's rows, cut into m micro-batches.
            rows = m * MICRO
            mine = slice(grid.dp_rank * rows, (grid.dp_rank + 1) * rows)
            batches = [
                (i[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO])
                for i, y in [(ids[mine], labels[mine])]
                for k in range(m)
            ]
            for engine_name in engines:
                for sg in sgs:
                    chunks = build_chunks(
                        cfg,
                        VOCAB,
                        p=pp,
                        rank=grid.pp_rank,
                        v=v,
                        tp_group=grid.groups.tp if tp > 1 else None,
                        seed=11,
                        sequence_parallel=sp,
                    )
                    engine = (
                        Engine(grid)
                        if engine_name == "none"
                        else build_engine(engine_name, grid, parallel_cfg)
                    )
                    modules = engine.wrap(chunks)
                    optimizer = engine.build_optimizer(
                        build_optimizer(chunks, train_cfg, torch.device("cpu")),
                        build_scaler("fp32", torch.device("cpu")),
                        0.0,
                        m,
                    )
                    work = ChunkWork(
                        chunks, engine, batches, modules, split_backward=schedule == "zb-h1"
                    )
                    shape = (MICRO, SEQ // tp if sp and tp > 1 else SEQ, cfg.d_model)
                    channel = (
                        Channel(
                            prev=grid.pp_prev,
                            next=grid.pp_next,
                            shape=shape,
                            dtype=torch.float32,
                            device=torch.device("cpu"),
                            tp_group=grid.groups.tp if tp > 1 else None,
                            scatter_gather=sg,
                            sequence_parallel=sp,
                        )
                        if pp > 1
                        else None
                    )
                    actions = rank_actions(schedule, pp, grid.pp_rank, m, v)
                    Runtime(channel).run(actions, work, split_backward=schedule == "zb-h1")
                    # The engine's reduction, the tp and tied-embedding sums.
                    engine.finalize_grads()
                    loss = (
                        torch.stack(list(work.losses.values())).mean()
                        if work.losses
                        else torch.zeros(())
                    )
                    if pp > 1:
                        dist.all_reduce(loss, group=grid.groups.pp)
                    if d > 1:
                        dist.all_reduce(loss, group=grid.groups.dp)
                        loss /= d
                    worst, worst_name = 0.0, ""
                    for chunk in chunks:
                        for name, param in chunk.named_parameters():
                            expected = expected_shard(
                                name, serial_grads[name], grid, chunk.padded_vocab
                            )
                            error = rel(param.grad, expected)
                            if error > worst:
                                worst, worst_name = error, name
                    norm = clip_grad_norm(
                        list(chunks.parameters()),
                        0.0,
                        grid.groups.tp if tp > 1 else None,
                        grid.groups.pp if pp > 1 else None,
                    )
                    print(
                        json.dumps(
                            {
                                "rank": grid.rank,
                                "schedule": schedule,
                                "m": m,
                                "v": v,
                                "engine": engine_name,
                                "sg": sg,
                                "sp": sp,
                                "loss": rel(loss, serial_loss.detach()),
                                "grad": worst,
                                "grad_worst": worst_name,
                                "norm": rel(norm, serial_norm),
                                "sent": channel.bytes_sent if channel else 0,
                                "params": sum(p.numel() for p in chunks.parameters()),
                            }
                        ),
                        flush=True,
                    )
                    if engine_name == "horovod":
                        optimizer.zero_grad()
    topology.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "MPI")
    main()
