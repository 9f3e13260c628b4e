"""Under mpirun with t ranks: a tensor-parallel GPT against the t = 1 GPT, same seed and data.

Prints one JSON line per rank: the largest relative differences of the logits, the loss, every
parameter's gradient (this rank's shard against the same shard of the serial gradient) and
the losses of 5 AdamW steps. The vocabulary (250) divides by no t, so padding is exercised.
Arguments: ``sp`` runs the parallel model with sequence parallelism; ``engine=NAME`` (ddp,
horovod or ps) makes the world t x d with d = world / t given by ``tp=T``: each data-parallel
replica then takes its part of the batch, and the engine's reduced gradients must equal the
serial model's on the whole batch.
"""

import json
import sys

import torch

from hpcllm import topology
from hpcllm.config import ModelConfig, load_config
from hpcllm.model.gpt import GPT
from hpcllm.parallel.data.builder import build_engine
from hpcllm.parallel.data.finalize import reduce_whole_grads_over_tp
from hpcllm.parallel.tensor.layers import shard_of
from hpcllm.parallel.tensor.mappings import count_comm
from hpcllm.train.optim import build_optimizer, build_scaler

VOCAB = 250
# How each parameter is split over tp ranks: (dim, stride), or None when replicated.
SPLIT = {
    "wte.weight": (0, 1),
    "attn.qkv.weight": (0, 3),
    "attn.qkv.bias": (0, 3),
    "attn.proj.weight": (1, 1),
    "mlp.fc.weight": (0, 1),
    "mlp.fc.bias": (0, 1),
    "mlp.proj.weight": (1, 1),
}


def split_of(name: str):
    for suffix, how in SPLIT.items():
        if name.endswith(suffix):
            return how
    return None


def expected_shard(name: str, full: torch.Tensor, grid, padded: int) -> torch.Tensor:
    """Return the slice of a serial tensor that tp rank ``grid.tp_rank`` should hold."""
    if name == "wte.weight":  # t pads the vocabulary further: pad the serial rows alike
        full = torch.cat([full[:VOCAB], full.new_zeros(padded - VOCAB, full.shape[1])])
    how = split_of(name)
    return shard_of(full, *how, grid.tp_rank, grid.tp) if how else full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def main() -> None:
    import os

    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    args = dict(a.split("=") if "=" in a else (a, "1") for a in sys.argv[1:])
    sp, engine_name = "sp" in args, args.get("engine")
    tp = int(args.get("tp", world))
    grid = topology.init(tp=tp)
    d = grid.dp
    cfg = ModelConfig(preset=None, n_layer=2, n_head=4, d_model=32, seq_len=16)
    serial = GPT(cfg, VOCAB, seed=11)
    parallel = GPT(cfg, VOCAB, seed=11, tp_group=grid.groups.tp, sequence_parallel=sp)
    parallel_config = load_config(None, []).parallel
    engine = build_engine(engine_name, grid, parallel_config) if engine_name else None
    module = engine.wrap([parallel])[0] if engine else parallel
    train = load_config(None, ["train.lr=1e-2"]).train
    scaler = build_scaler("fp32", torch.device("cpu"))

    def mine(batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel replica's rows of a global batch."""
        rows = batch.shape[0] // d
        return batch[grid.dp_rank * rows : (grid.dp_rank + 1) * rows]

    def parallel_backward(loss: torch.Tensor, optimizer) -> None:
        loss.backward()
        if engine:
            engine.finalize_grads()  # the reduction over d, then the tp sums
        else:
            reduce_whole_grads_over_tp(parallel.parameters(), grid.groups.tp)

    def dp_mean(value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        if d > 1:
            torch.distributed.all_reduce(value, group=grid.groups.dp)
            value /= d
        return value

    optimizers = [
        build_optimizer(serial, train, torch.device("cpu")),
        build_optimizer(parallel, train, torch.device("cpu")),
    ]
    if engine:
        optimizers[1] = engine.build_optimizer(optimizers[1], scaler, 0.0, 1)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4 * d, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (4 * d, 16), generator=gen)
    out = {
        "rank": grid.rank,
        "tp": grid.tp,
        "dp": d,
        "sp": parallel.sequence_parallel,
        "padded_vocab": parallel.padded_vocab,
        "vocab_rows": parallel.wte.weight.shape[0],
    }
    with torch.no_grad():
        out["logits"] = rel(parallel(mine(ids)), serial(mine(ids)))
        full = dict(serial.named_parameters())
        out["init"] = max(
            rel(p, expected_shard(n, full[n], grid, parallel.padded_vocab))
            for n, p in parallel.named_parameters()
        )
    serial_loss = serial(ids, labels)
    with count_comm() as comm:
        parallel_loss = module(mine(ids), mine(labels))
        parallel_backward(parallel_loss, optimizers[1])
    out["comm"] = sorted({op for op, _, _ in comm.calls})
    out["loss"] = rel(dp_mean(parallel_loss), serial_loss.detach())
    serial_loss.backward()
    grads = dict(serial.named_parameters())
    worst = {}
    for name, param in parallel.named_parameters():
        expected = expected_shard(name, grads[name].grad, grid, parallel.padded_vocab)
        worst[name] = rel(param.grad, expected)
    out["grad"] = max(worst.values())
    out["grad_worst"] = max(worst, key=worst.get)
    serial_losses, parallel_losses = [], []
    for optimizer in optimizers:
        optimizer.zero_grad()
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, VOCAB, (4 * d, 16), generator=g)
        y = torch.randint(0, VOCAB, (4 * d, 16), generator=g)
        loss = serial(x, y)
        loss.backward()
        optimizers[0].step()
        optimizers[0].zero_grad()
        serial_losses.append(loss.item())
        loss = module(mine(x), mine(y))
        parallel_backward(loss, optimizers[1])
        optimizers[1].step()
        optimizers[1].zero_grad()
        parallel_losses.append(dp_mean(loss).item())
    out["serial_losses"], out["parallel_losses"] = serial_losses, parallel_losses
    print(json.dumps(out), flush=True)
    topology.shutdown()


if __name__ == "__main__":
    main()
