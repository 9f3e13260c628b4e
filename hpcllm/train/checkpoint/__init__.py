"""Checkpoints: files named by the axes that cut them, a manifest of checksums, a rename.

```
RUN_DIR/checkpoints/
  step_00000200/
    model_tp00_pp00.pt         the named parts of that (tp, pp) shard: model, optimizer,
                               scaler, rng, and any other part the run tracks
    optimizer_tp00_pp00_dp000.pt   with parallel.distributed_optimizer: dp rank 0's part of
                                   that shard's optimizer state (one file per dp rank);
                                   with local-sgd: dp rank 0's own optimizer state
    experts_tp00_pp00_ep01.pt  at parallel.ep > 1: ep rank 1's routed experts and their
                               optimizer state (one file per ep rank; the model file holds
                               the rest of those parts)
    meta.json                  step, consumed samples, grid sizes, format_version
    config.yaml                the run's resolved config
    manifest.json              size and CRC-32 of every file above, the layout and the
                               named parts, written last
  latest                       "step_00000200", replaced last (for people and tools)
```

A file is named by every axis that cuts it (:class:`~.format.Layout`: the model file by tp and
pp, the optimizer's own files by tp, pp and dp) and written by the first of the ranks that
hold it: data-parallel replicas hold the same model file, so only dp rank 0 of each (tp, pp)
writes it (under the distributed optimizer every dp rank also writes its part of the optimizer
state, which :func:`~.read.read_shard` merges back into the plain state, so a checkpoint
resumes at any d). At ep > 1 each ep rank's first expert-dp replica writes the experts it
holds, and :func:`~.read.read_shard` joins them and cuts them for a rank of any ep, reading
only the files that hold its experts. The manifest records the layout (each axis's size, the
axes of each kind of file), so the next axis adds a kind of file or a name to the files it
cuts, not a format. Every file goes into a hidden ``.step_….partial`` folder; each writing
rank computes its shard's checksum while writing it and the ranks gather those to rank 0,
which writes meta.json, config.yaml, then manifest.json, and renames the folder. A checkpoint
is therefore a folder whose manifest vouches for every file in it; one without a valid
manifest does not exist.

manifest.json::

    {"format_version": 3, "step": 200, "checksum": "crc32",
     "layout": {"axes": {"tp": 2, "pp": 2, "dp": 4},
                "files": {"model": ["tp", "pp"], "optimizer": ["tp", "pp", "dp"]}},
     "parts": ["model", "optimizer", "scaler", "rng"],
     "files": {"config.yaml": {"bytes": 1834, "crc32": "5f1c09aa"}, ...}}

Format 2 (before layouts and named parts) had the same file names and the same four parts in
each model file; a reader takes its layout from meta.json (tp, pp, and ``optimizer_shards`` or
``optimizer_replicas``), so such checkpoints load and resume as they are.

The checksum is zlib's CRC-32, streamed in 8 MiB chunks. The threat is a torn, truncated or
bit-flipped file, not an attacker (who could rewrite the manifest too; ``weights_only``
loading is the defence against malicious pickles): CRC-32 catches every burst of up to 32
flipped bits and misses random damage once in 4·10⁹, the size check catches truncation, and
it runs at about 3 GB/s on one core against 0.8 for BLAKE2b, which matters because resuming
reads the whole newest checkpoint on rank 0 (:func:`~.find.resumable`).

Resuming never trusts ``latest``: :func:`~.find.resumable` walks the step folders newest first and
takes the first that verifies. A folder without manifest.json whose meta.json has no
``format_version`` may be format 1 (written before manifests, when the rename alone made a
folder complete), or a damaged folder that lost both: the two cannot be told apart, so it is
refused in one line naming the opt-in (``run.allow_unverified``, ``--allow-unverified``), and
with it loaded unchecked with a warning. With format 2 a missing manifest means damage.

Shards are read with ``torch.load(weights_only=True)``, which unpickles only tensors and
plain containers. RNG states are stored in that vocabulary (numpy's keys as an int64 tensor).
Format-1 shards hold numpy's state tuple with an ndarray: they are read by allowing numpy's
array reconstruction and nothing more (:func:`~.read._format_1_globals`), and their RNG state is
converted to format 2's on load, so a converted or resumed run writes the current format only.

A save that fails on any rank (disk full, quota) is agreed by all ranks before anyone moves
on: each phase ends with an all-gather of every rank's error, so no rank waits in a
collective that another skipped. The partial folder is removed, earlier checkpoints are
untouched, and every rank raises the same one-line :class:`UserError` (or warns, with
``on_failure="warn"``, and training goes on).
"""

from hpcllm.train.checkpoint.find import (
    Verdict,
    agreed_resumable,
    checkpoints,
    latest,
    refuse_unverified,
    resumable,
    step_of,
    verify,
)
from hpcllm.train.checkpoint.format import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    Layout,
    checksum,
    describe,
    read_manifest,
    read_meta,
    stderr_warning,
)
from hpcllm.train.checkpoint.read import check_same_model, load_shard, read_shard
from hpcllm.train.checkpoint.rng import RandomStates, rng_state, set_rng_state
from hpcllm.train.checkpoint.write import prune, save, write_offline

__all__ = [
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "Layout",
    "RandomStates",
    "Verdict",
    "agreed_resumable",
    "check_same_model",
    "checkpoints",
    "checksum",
    "describe",
    "latest",
    "load_shard",
    "prune",
    "read_manifest",
    "read_meta",
    "read_shard",
    "refuse_unverified",
    "resumable",
    "rng_state",
    "save",
    "set_rng_state",
    "step_of",
    "stderr_warning",
    "verify",
    "write_offline",
]
