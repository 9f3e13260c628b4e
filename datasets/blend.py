"""Weighted blends of prepared datasets (``data.blend``): which source each sample comes from.

A blend is one stream of samples drawn from several prepared folders made with one tokenizer.
Global sample ``n`` (0, 1, ... over the whole run, counted as ``consumed_samples`` counts them)
comes from the source chosen for it by :class:`BlendOrder`, and is that source's next sample:
a source's ``j``-th sample is sample ``permutation(seed, e)[j mod n_i]`` of its train split,
``e = j // n_i`` its epoch (the order its own reader visits it in, whole epochs), so a source
that runs out starts a new epoch of itself. Which source comes next depends only on how many
samples each has given so far, so the stream is the same at any d; rank ``r`` of ``d`` takes
the ``b`` samples at ``t*d*b + r*b`` of global micro-step ``t``, as the single-folder reader
does.

The order keeps every prefix of the stream within one sample of the weights: after ``n``
samples, source ``i`` has given ``c_i(n)`` with ``|c_i(n) - w_i n| <= 1 - 1/(2k - 2)`` for
``k >= 2`` sources (Tijdeman, "The chairman assignment problem", Discrete Math. 32, 1980).
Megatron-LM's BlendedDataset picks the source furthest behind its share, ``argmax w_i (n+1) -
c_i``, which keeps two or three sources within one sample but not more: five sources weighted
0.01, 0.44, 0.03, 0.51 and 0.01 stray 1.07 samples from their shares within the first 400
(tests/test_blend.py), where this rule stays within 0.875.

A blend's position is ``consumed_samples`` and the counts ``c_i`` there: a checkpoint part
(:class:`BlendPosition`) saves them with each source's name, weight and data hash, and a
resumed run continues the order from them, at the same d or another.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcllm.config import BatchPlan
from hpcllm.datasets.reader import (
    VAL_ADVICE,
    MicroBatch,
    MicroBatchReader,
    ShardDataset,
    epoch_permutation,
)
from hpcllm.datasets.shards import Manifest, load_manifest, make_data_hint
from hpcllm.errors import UserError

# The checkpoint part that holds a blend's position.
BLEND_PART = "data_blend"
# A source may be chosen when it is this close to eligible: the weights are floats.
_SLACK = 1e-12


class BlendOrder:
    """Which source each sample of a blend comes from: Tijdeman's rule.

    At sample ``n`` (1-based), a source is eligible while it is at least ``delta = 1/(2k-2)``
    behind its share (``w_i n - c_i >= delta``); of the eligible, the one whose next sample is
    due first (smallest ``(c_i + 1 - delta) / w_i``) is taken, the lowest index on a tie.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        total = float(sum(weights))
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"a blend's weights are positive, got {list(weights)}")
        self.weights = [float(w) / total for w in weights]
        k = len(self.weights)
        self.delta = 1.0 / (2 * k - 2) if k > 1 else 0.0

    @property
    def bound(self) -> float:
        """Return the most a source's count strays from ``w_i n`` (0 for one source)."""
        return 1.0 - self.delta if len(self.weights) > 1 else 0.0

    def take(self, start: int, counts: list[int], size: int) -> np.ndarray:
        """Return the sources of samples ``start .. start + size - 1`` (int32), given the
        ``counts`` each source had given before ``start``; ``counts`` is advanced in place."""
        out = np.zeros(size, dtype=np.int32)
        weights = self.weights
        if len(weights) == 1:
            counts[0] += size
            return out
        delta, ready = self.delta, self.delta - _SLACK
        every = range(len(weights))
        for at in range(size):
            n = start + at + 1
            best, due = -1, float("inf")
            for i in every:
                w, c = weights[i], counts[i]
                if w * n - c >= ready:
                    when = (c + 1 - delta) / w
                    if when < due:
                        best, due = i, when
            if best < 0:  # never, by Tijdeman's theorem; kept total all the same
                best = max(every, key=lambda i: weights[i] * n - counts[i])
            counts[best] += 1
            out[at] = best
        return out

    def counts_at(self, n: int, start: int = 0, counts: Sequence[int] | None = None) -> list[int]:
        """Return each source's count after ``n`` samples, going on from ``counts`` at
        ``start`` (zeros at 0)."""
        now = list(counts) if counts is not None else [0] * len(self.weights)
        step = 1 << 16
        while start < n:
            size = min(step, n - start)
            self.take(start, now, size)
            start += size
        return now


def data_hash(manifest: Manifest) -> str:
    """Return a prepared folder's identity: the sha256 of its manifest without the prepare's
    timings and files' names, so the same data prepared again hashes the same."""
    raw = dict(manifest.raw)
    raw.pop("prepare", None)
    splits = {
        split: [{k: v for k, v in shard.items() if k != "file"} for shard in shards]
        for split, shards in raw.get("splits", {}).items()
    }
    raw["splits"] = splits
    tokenizer = {k: v for k, v in raw.get("tokenizer", {}).items() if "file" not in k}
    raw["tokenizer"] = tokenizer
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


@dataclass
class BlendSource:
    """One folder of a blend: its name, path, normalised weight and manifest."""

    name: str
    path: str
    weight: float
    manifest: Manifest

    @property
    def hash(self) -> str:
        return data_hash(self.manifest)


class Blend:
    """The prepared folders of ``data.blend``, read and checked: one tokenizer, every folder
    whole. ``manifest`` is the first source's, which speaks for the blend's tokenizer."""

    def __init__(self, entries: Sequence[Sequence[Any]]) -> None:
        if not entries:
            raise UserError("data.blend needs at least one source")
        total = sum(float(e[1]) for e in entries)
        sources = []
        for path, weight, name in entries:
            if not Path(path).exists():
                raise UserError(
                    f"data.blend source {name}: {path} does not exist; {make_data_hint(path)}"
                )
            try:
                manifest = load_manifest(path)
            except UserError as err:
                raise UserError(f"data.blend source {name}: {err}") from None
            sources.append(BlendSource(str(name), str(path), float(weight) / total, manifest))
        self.sources = sources
        self.order = BlendOrder([s.weight for s in sources])
        _check_one_tokenizer(sources)

    @property
    def manifest(self) -> Manifest:
        """Return the manifest that speaks for the blend's tokenizer (the first source's)."""
        return self.sources[0].manifest

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def check(self, seq_len: int) -> None:
        """Raise a UserError naming the first source whose train split holds no sample of
        ``seq_len`` tokens."""
        for source in self.sources:
            try:
                ShardDataset(source.manifest, "train", seq_len)
            except UserError as err:
                raise UserError(f"data.blend source {source.name}: {err}") from None

    def planned(self, samples: int, seq_len: int) -> list[tuple[BlendSource, int, int, float]]:
        """Return, for each source, (source, its train samples, samples it gives to the first
        ``samples`` of the stream (within one: ``w_i * samples`` rounded), epochs of it)."""
        rows = []
        for source in self.sources:
            own = ShardDataset(source.manifest, "train", seq_len).n_samples
            drawn = round(source.weight * samples)
            rows.append((source, own, drawn, drawn / own))
        return rows

    def describe(self) -> list[dict[str, Any]]:
        """Return what a checkpoint records of each source: name, path, weight, data hash."""
        return [
            {"name": s.name, "path": s.path, "weight": s.weight, "hash": s.hash}
            for s in self.sources
        ]


def _check_one_tokenizer(sources: list[BlendSource]) -> None:
    """Raise a UserError naming the source whose tokenizer is not the others'."""

    def tokenizer(source: BlendSource) -> tuple[str, str | None]:
        raw = source.manifest.raw["tokenizer"]
        return raw["sha256"], raw.get("config_sha256")

    kinds = [tokenizer(s) for s in sources]
    # The blend's tokenizer is the one most sources share (the first source's on a tie).
    common = max(kinds, key=lambda kind: (kinds.count(kind), -kinds.index(kind)))
    for source, kind in zip(sources, kinds, strict=True):
        if kind != common:
            sharing = [s.name for s, k in zip(sources, kinds, strict=True) if k == common]
            raise UserError(
                f"data.blend source {source.name} ({source.path}) was made with another "
                f"tokenizer (sha256 {kind[0][:12]}…) than {', '.join(sharing)} "
                f"({common[0][:12]}…); a blend's folders share one tokenizer: prepare it "
                f"again with --tokenizer {sources[kinds.index(common)].manifest.tokenizer_path}"
            )


class BlendedReader:
    """Iterates this data-parallel rank's micro-batches of a blend forever.

    The train split of every source, mixed in :class:`BlendOrder`'s order from
    ``consumed_samples``, where the sources had given ``counts`` (zeros at 0). Like
    :class:`~hpcllm.datasets.reader.MicroBatchReader`, a background thread reads ``prefetch``
    micro-batches ahead; :meth:`counts_at` gives the blend's position at any micro-step
    boundary the reader has passed.
    """

    def __init__(
        self,
        blend: Blend,
        *,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        consumed_samples: int = 0,
        counts: Sequence[int] | None = None,
        prefetch: int = 4,
        cache_bytes: int = 64 << 20,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank {dp_rank} outside data-parallel size {dp_size}")
        self.blend = blend
        self.datasets = [
            ShardDataset(s.manifest, "train", seq_len, cache_bytes) for s in blend.sources
        ]
        self.seq_len = seq_len
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.prefetch = max(1, prefetch)
        self.plan = BatchPlan(micro_batch_size, 1, dp_size)
        if consumed_samples < 0 or consumed_samples % self.plan.micro_step:
            raise UserError(
                f"consumed_samples {consumed_samples} is not a multiple of the "
                f"global micro-batch {self.plan.micro_step} (d x micro-batch size)"
            )
        if counts is None:
            counts = blend.order.counts_at(consumed_samples)
        counts = [int(c) for c in counts]
        if len(counts) != len(blend.sources) or sum(counts) != consumed_samples:
            raise ValueError(f"counts {counts} are no position at sample {consumed_samples}")
        self.consumed_samples = consumed_samples
        self.counts = counts
        # Positions the reader has passed (micro-step boundaries), for counts_at.
        self._lock = threading.Lock()
        self._start = (consumed_samples, tuple(counts))
        self._passed: dict[int, tuple[int, ...]] = {consumed_samples: tuple(counts)}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def n_samples(self) -> list[int]:
        """Return each source's train samples."""
        return [d.n_samples for d in self.datasets]

    def counts_at(self, consumed: int) -> list[int]:
        """Return how many samples each source had given after ``consumed`` samples."""
        with self._lock:
            known = self._passed.get(consumed)
            start, counts = self._start
        if known is not None:
            return list(known)
        if consumed < start:
            raise ValueError(f"sample {consumed} is before this reader's start {start}")
        return self.blend.order.counts_at(consumed, start, counts)

    def _sample(self, source: int, j: int) -> int:
        """Return the index in source ``source`` of its ``j``-th sample of the blend."""
        n = self.datasets[source].n_samples
        epoch, at = divmod(j, n)
        perm = self._perms.get((source, epoch))
        if perm is None:
            for key in [k for k in self._perms if k[0] == source]:
                del self._perms[key]
            perm = self._perms[source, epoch] = epoch_permutation(n, self.seed, epoch)
        return int(perm[at])

    def _batches(self) -> Iterator[tuple[np.ndarray, int, tuple[int, ...]]]:
        consumed, counts = self.consumed_samples, list(self.counts)
        per_step, b = self.plan.micro_step, self.micro_batch_size
        first = self.dp_rank * b
        dtype = self.datasets[0].dtype
        while True:
            running = list(counts)
            sources = self.blend.order.take(consumed, counts, per_step).tolist()
            # Each sample's number within its source: the source's count before it.
            within = []
            for source in sources:
                within.append(running[source])
                running[source] += 1
            out = np.empty((b, self.seq_len + 1), dtype=dtype)
            for row in range(b):
                source = sources[first + row]
                self.datasets[source].window(self._sample(source, within[first + row]), out[row])
            consumed += per_step
            position = tuple(counts)
            with self._lock:
                self._passed[consumed] = position
                if len(self._passed) > 4096:  # the oldest go; counts_at replays if asked
                    for key in sorted(self._passed)[:2048]:
                        del self._passed[key]
            yield out, consumed, position

    def __iter__(self) -> Iterator[MicroBatch]:
        import torch

        stop = threading.Event()
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)

        def produce() -> None:
            try:
                for item in self._batches():
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as err:  # handed to the consumer, raised there
                ready.put(err)

        worker = threading.Thread(target=produce, name="hpcllm-blend-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                tokens, consumed, counts = item
                tokens = torch.from_numpy(tokens.astype(np.int64))
                self.consumed_samples, self.counts = consumed, list(counts)
                epoch = min(c // n for c, n in zip(counts, self.n_samples, strict=True))
                yield MicroBatch(tokens[:, :-1], tokens[:, 1:], epoch, consumed)
        finally:
            stop.set()
            worker.join(timeout=5)


class BlendPosition:
    """The blend's position as a named checkpoint part (``data_blend``): the consumed samples,
    each source's count there, and each source's name, weight and data hash.

    ``consumed`` returns the run's consumed samples when a checkpoint is saved; the counts are
    the reader's at that point. Loading checks the saved sources against the blend's: a
    folder whose data changed, or a blend of other sources or weights, is refused in one line.
    """

    def __init__(self, blend: Blend, consumed: Callable[[], int]) -> None:
        self.blend = blend
        self.consumed = consumed
        self.reader: BlendedReader | None = None
        self.resumed: tuple[int, list[int]] | None = None

    def state_dict(self) -> dict[str, Any]:
        consumed = self.consumed()
        if self.reader is None:
            counts = self.blend.order.counts_at(consumed)
        else:
            counts = self.reader.counts_at(consumed)
        return {"consumed_samples": consumed, "counts": counts, "sources": self.blend.describe()}

    def meta(self) -> dict[str, Any]:
        """Return what meta.json says of the position: the samples each source has given."""
        state = self.state_dict()
        return {
            "consumed_samples": state["consumed_samples"],
            "samples": dict(zip(self.blend.names, state["counts"], strict=True)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {s["name"]: s for s in state["sources"]}
        mine = self.blend.describe()
        if [s["name"] for s in state["sources"]] != [s["name"] for s in mine] or any(
            abs(saved[s["name"]]["weight"] - s["weight"]) > 1e-9 for s in mine
        ):
            then = ", ".join(f"{s['name']} {s['weight']:.4g}" for s in state["sources"])
            now = ", ".join(f"{s['name']} {s['weight']:.4g}" for s in mine)
            raise UserError(
                f"data.blend is not the checkpoint's blend (its sources and weights: {then}; "
                f"now: {now}); a blend resumes as it was saved: restore data.blend, or start "
                "another run (run.dir)"
            )
        for source in mine:
            if saved[source["name"]]["hash"] != source["hash"]:
                raise UserError(
                    f"data.blend source {source['name']} ({source['path']}) is not the data the "
                    f"checkpoint drew from (its manifest changed since; it was "
                    f"{saved[source['name']]['path']}): a blend resumes only on its own data; "
                    "restore that folder, or start another run (run.dir)"
                )
        self.resumed = (int(state["consumed_samples"]), [int(c) for c in state["counts"]])

    def reader_for(
        self,
        *,
        consumed_samples: int,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        prefetch: int,
    ) -> BlendedReader:
        """Return the rank's reader from ``consumed_samples`` (the run's state), continuing the
        loaded position where there is one."""
        counts = None
        if self.resumed is not None:
            at, counts = self.resumed
            if at != consumed_samples:
                raise UserError(
                    f"the checkpoint's blend position is at sample {at}, its step at "
                    f"{consumed_samples}: the checkpoint is not whole; resume an earlier one"
                )
        self.reader = BlendedReader(
            self.blend,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            consumed_samples=consumed_samples,
            counts=counts,
            prefetch=prefetch,
        )
        return self.reader


def validation_readers(
    blend: Blend,
    *,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    warn: Callable[[str], None],
) -> dict[str, tuple[float, MicroBatchReader]]:
    """Return each source's validation reader with its weight, by name; a source without a
    val split is left out (``warn`` says so), and a split too small for one global
    micro-batch is a UserError naming the source."""
    readers = {}
    for source in blend.sources:
        if source.manifest.n_tokens("val") == 0:
            warn(
                f"data.blend source {source.name} has no validation split; the blended "
                "val_loss weighs the others"
            )
            continue
        try:
            reader = MicroBatchReader(
                source.manifest,
                split="val",
                seq_len=seq_len,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=seed,
                prefetch=2,
                advice=VAL_ADVICE,
            )
        except UserError as err:
            raise UserError(f"data.blend source {source.name}: {err}") from None
        readers[source.name] = (source.weight, reader)
    return readers


def blend_lines(blend: Blend, samples: int, seq_len: int) -> list[str]:
    """Return the banner's lines of a blend: each source's weight, folder, train samples, and
    what the run's ``samples`` draw of it (within one sample) and how many epochs that is."""
    rows = blend.planned(samples, seq_len)
    width = max(len(s.name) for s in blend.sources)
    lines = [
        f"blend of {len(rows)} folder(s) (data.blend), one tokenizer; the run's {samples} "
        "samples draw:"
    ]
    for source, own, drawn, epochs in rows:
        lines.append(
            f"{source.name:<{width}}  weight {source.weight:.4f}  {drawn} samples, "
            f"{epochs:.2f} epochs of {own} ({source.path})"
        )
    return lines
