"""Builds the data-parallel engine ``parallel.dp_engine`` names: the synchronous ones of
:mod:`hpcllm.parallel.data_parallel` and the asynchronous ones of
:mod:`hpcllm.parallel.async_engines` (which builds on the former, so neither can import the
other's builder without a cycle)."""

from __future__ import annotations

from hpcllm.config import ParallelConfig
from hpcllm.errors import UserError
from hpcllm.parallel.async_engines import build_async_engine
from hpcllm.parallel.data_parallel import (
    ENGINES,
    DDPEngine,
    DistributedOptimizerEngine,
    Engine,
    HorovodEngine,
    ParameterServerEngine,
)
from hpcllm.topology import Grid


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
    if name == "ps":
        if parallel.dp_compression != "none":
            raise UserError("parallel.dp_compression applies to ddp and horovod, not ps")
        return ParameterServerEngine(grid)
    if name in ("ps-async", "local-sgd"):
        return build_async_engine(name, grid, parallel)
    raise UserError(f"parallel.dp_engine must be one of {', '.join(ENGINES)}, got {name!r}")
