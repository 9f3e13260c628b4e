"""Under mpirun: a run's newest checkpoint loaded into its own layout, logits of fixed tokens.

Usage: mpirun -np N python checkpoint_logits.py RUN_DIR OUT.pt

Every rank builds its chunks as the trainer does (t, p from the run's config), loads its own
shard, and the pipeline runs one forward of the tokens (the first stage embeds, each stage
passes its activation on by point-to-point send); the last stage's first tensor-parallel rank
saves the logits (gathered over the tp group) with the tokens.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpcllm import topology
from hpcllm.model.stages import build_chunks, load_chunks_state_dict
from hpcllm.train import checkpoint
from hpcllm.train.reshard import checkpoint_config


def main() -> None:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    folder = checkpoint.resumable(run_dir, print)
    cfg = checkpoint_config(folder)
    vocab = checkpoint.read_meta(folder)["vocab_size"]
    p = cfg.parallel
    grid = topology.init(tp=p.tp, pp=p.pp)
    assert p.vpp == 1, "one chunk per rank: the forward below runs chunk 0"
    chunks = build_chunks(
        cfg.model,
        vocab,
        p=p.pp,
        rank=grid.pp_rank,
        v=1,
        tp_group=grid.groups.tp if p.tp > 1 else None,
        seed=cfg.train.seed,
        sequence_parallel=False,
        layers=p.pipeline_layers,
    )
    shard = checkpoint.load_shard(folder, grid.tp_rank, grid.pp_rank, p.tp, p.pp)
    load_chunks_state_dict(chunks, p.pp, shard["model"])
    chunk = chunks[0].eval()
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        if chunk.pre:
            x = tokens
        else:
            x = torch.empty(2, tokens.shape[1], cfg.model.d_model)
            dist.recv(x, grid.pp_prev)
        y = chunk(x)
        if not chunk.post:
            dist.send(y.contiguous(), grid.pp_next)
    if chunk.post and grid.tp_rank == 0 and grid.dp_rank == 0:
        torch.save({"tokens": tokens, "logits": y}, out)
    dist.barrier()


if __name__ == "__main__":
    main()
