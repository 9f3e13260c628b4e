"""Under mpirun: Horovod all-reduce and one DistributedOptimizer step, printed as JSON.

Usage: mpirun -np N python horovod_step.py TP

Horovod is initialised on the grid's data-parallel communicator, so with TP > 1 each tp slice
has its own Horovod world, side by side with gloo tensor-parallel groups in the same process.
"""

import json
import sys

import horovod.torch as hvd
import torch
import torch.distributed as dist

from hpcllm import topology


def batch_for(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)


def main() -> None:
    grid = topology.init(tp=int(sys.argv[1]))
    hvd.init(comm=grid.groups.dp_comm)
    out = {
        "rank": grid.rank,
        "hvd_rank": hvd.rank(),
        "hvd_size": hvd.size(),
        "mpi_built": hvd.mpi_built(),
        "mpi_enabled": hvd.mpi_enabled(),
    }

    value = torch.tensor([float(grid.rank + 1)])
    out["sum"] = hvd.allreduce(value, op=hvd.Sum, name="sum").item()
    out["average"] = hvd.allreduce(value, op=hvd.Average, name="average").item()
    # A gloo all-reduce over the tp group in the same process, after Horovod started.
    tp_value = torch.tensor([float(grid.rank + 1)])
    dist.all_reduce(tp_value, group=grid.groups.tp)
    out["tp_sum"] = tp_value.item()

    # Each rank starts from different weights; broadcast must make them rank 0's.
    torch.manual_seed(grid.rank)
    model = torch.nn.Linear(4, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out["initial"] = {k: v.tolist() for k, v in model.state_dict().items()}
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = batch_for(grid.dp_rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    out["after"] = {k: v.tolist() for k, v in model.state_dict().items()}
    print(json.dumps(out), flush=True)
    hvd.shutdown()
    topology.shutdown()


if __name__ == "__main__":
    main()
