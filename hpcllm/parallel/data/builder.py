"""The data-parallel engine ``parallel.dp_engine`` names, set up from the config."""

from __future__ import annotations

from hpcllm.config import ParallelConfig
from hpcllm.errors import UserError
from hpcllm.parallel.data.ddp import DDPEngine
from hpcllm.parallel.data.distributed_optimizer import DistributedOptimizerEngine
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.horovod import HorovodEngine
from hpcllm.parallel.data.local_sgd import LocalSGDEngine
from hpcllm.parallel.data.ps import ParameterServerEngine
from hpcllm.parallel.data.ps_async import AsyncParameterServerEngine
from hpcllm.topology import Grid

ENGINES = ("ddp", "horovod", "ps", "ps-async", "local-sgd")


def build_engine(
    name: str, grid: Grid, parallel: ParallelConfig, param_dtype: str = "fp32"
) -> Engine:
    """Return the data-parallel engine ``parallel.dp_engine`` names, set up from ``parallel``.

    ``param_dtype`` (``train.param_dtype``) is the weights' dtype, which only the
    distributed optimizer (holding the fp32 masters) takes other than fp32.
    """
    if parallel.distributed_optimizer:  # config.check refused it with ps and compression
        return DistributedOptimizerEngine(grid, parallel, name, param_dtype)
    if name == "ddp":
        return DDPEngine(
            grid, parallel.ddp_bucket_mb, parallel.ddp_bucket_view, parallel.dp_compression
        )
    if name == "horovod":
        return HorovodEngine(grid, parallel, parallel.dp_compression)
    if name == "ps":  # config.check refused compression with it
        return ParameterServerEngine(grid)
    if name == "ps-async":
        return AsyncParameterServerEngine(grid, parallel.max_staleness, parallel.ps_async_order)
    if name == "local-sgd":
        return LocalSGDEngine(grid, parallel)
    raise UserError(f"parallel.dp_engine must be one of {', '.join(ENGINES)}, got {name!r}")
