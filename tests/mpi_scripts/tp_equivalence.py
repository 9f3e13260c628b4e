"""Under mpirun with t ranks: a tensor-parallel GPT against the t = 1 GPT, same seed and data.

Prints one JSON line per rank: the largest relative differences of the logits, the loss, every
parameter's gradient (this rank's shard against the same shard of the serial gradient) and
the losses of 5 AdamW steps. The vocabulary (250) divides by no t, so padding is exercised.
"""

import json

import torch

from hpcllm import topology
from hpcllm.config import ModelConfig, load_config
from hpcllm.model.gpt import GPT
from hpcllm.parallel.tensor import shard_of
from hpcllm.train.optim import build_optimizer

VOCAB = 250
# How each parameter is split over tp ranks: (dim, stride), or None when replicated.
SPLIT = {"wte.weight": (0, 1), "attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3),
         "attn.proj.weight": (1, 1), "mlp.fc.weight": (0, 1), "mlp.fc.bias": (0, 1),
         "mlp.proj.weight": (1, 1)}


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


if __name__ == "__main__":
    import os

    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    grid = topology.init(tp=world)
    cfg = ModelConfig(preset=None, n_layer=2, n_head=4, d_model=32, seq_len=16)
    serial = GPT(cfg, VOCAB, seed=11)
    parallel = GPT(cfg, VOCAB, seed=11, tp_group=grid.tp_group)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (3, 16), generator=gen)
    out = {"rank": grid.rank, "tp": grid.tp,
           "padded_vocab": parallel.padded_vocab, "vocab_rows": parallel.wte.weight.shape[0]}
    with torch.no_grad():
        out["logits"] = rel(parallel(ids), serial(ids))
        full = dict(serial.named_parameters())
        out["init"] = max(rel(p, expected_shard(n, full[n], grid, parallel.padded_vocab))
                          for n, p in parallel.named_parameters())
    serial_loss, parallel_loss = serial(ids, labels), parallel(ids, labels)
    out["loss"] = rel(parallel_loss.detach(), serial_loss.detach())
    serial_loss.backward()
    parallel_loss.backward()
    grads = dict(serial.named_parameters())
    worst = {}
    for name, param in parallel.named_parameters():
        expected = expected_shard(name, grads[name].grad, grid, parallel.padded_vocab)
        worst[name] = rel(param.grad, expected)
    out["grad"] = max(worst.values())
    out["grad_worst"] = max(worst, key=worst.get)
    train = load_config(None, ["train.lr=1e-2"]).train
    losses = []
    for model in (serial, parallel):
        model.zero_grad()
        opt = build_optimizer(model, train, torch.device("cpu"))
        mine = []
        for step in range(5):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randint(0, VOCAB, (4, 16), generator=g)
            y = torch.randint(0, VOCAB, (4, 16), generator=g)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mine.append(loss.item())
        losses.append(mine)
    out["serial_losses"], out["parallel_losses"] = losses
    print(json.dumps(out), flush=True)
    topology.shutdown()
