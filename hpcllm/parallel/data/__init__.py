"""Data parallelism: the engines behind ``parallel.dp_engine``, a module each.

- :mod:`~hpcllm.parallel.data.engine`: the protocol every engine follows (:class:`Engine`)
  and the one that ps-async adds (:class:`~hpcllm.parallel.data.engine.RunsSegments`);
- :mod:`~hpcllm.parallel.data.optimizer`: the optimizer the trainer steps, whose ``step()``
  unscales, clips by the global norm, skips on inf/NaN and returns (grad norm, skipped);
- :mod:`~hpcllm.parallel.data.finalize`: the gradient sums every engine finishes with (tensor-
  parallel, tied embedding) and the global norm;
- :mod:`~hpcllm.parallel.data.flat`: flat buffers and broadcasts the engines share;
- :mod:`~hpcllm.parallel.data.ddp`, :mod:`~hpcllm.parallel.data.horovod` (with its settings),
  :mod:`~hpcllm.parallel.data.ps`, :mod:`~hpcllm.parallel.data.ps_async`,
  :mod:`~hpcllm.parallel.data.local_sgd`, :mod:`~hpcllm.parallel.data.distributed_optimizer`
  (ZeRO-1): one engine each;
- :mod:`~hpcllm.parallel.data.builder`: the engine ``parallel.dp_engine`` names.
"""
