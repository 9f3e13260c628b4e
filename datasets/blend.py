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
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcllm.config import BatchPlan
from hpcllm.datasets.reader import (
    MicroBatch,
    MicroBatchReader,
    ShardDataset,
    check_position,
    epoch_permutation,
    prefetched,
    validation_reader,
)
from hpcllm.datasets.shards import Manifest, load_manifest, make_data_hint
from hpcllm.errors import UserError

# The checkpoint part that holds a blend's position.
BLEND_PART = "data_blend"
# A source may be chosen when it is this close to eligible: the weights are floats.
_SLACK = 1e-12


@dataclass(frozen=True)
class Phase:
    """Where the blend's order began: global sample ``start``, where the sources had given
    ``before`` samples each (a run that changed its blend, or began one, mid-way). The order
    runs on the samples since ``start``; a source's own order goes on from its count."""

    start: int = 0
    before: tuple[int, ...] = ()

    def of(self, k: int) -> Phase:
        """Return this phase with ``before`` filled in for ``k`` sources (zeros if empty)."""
        return self if self.before else Phase(self.start, (0,) * k)


class BlendOrder:
    """Which source each sample of a blend comes from: Tijdeman's rule.

    At sample ``n`` (1-based), a source is eligible while it is at least ``delta = 1/(2k-2)``
    behind its share (``w_i n - c_i >= delta``); of the eligible, the one whose next sample is
    due first (smallest ``(c_i + 1 - delta) / w_i``) is taken, the lowest index on a tie.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"a blend's weights are positive, got {list(weights)}")
        self.weights = normalised(weights)
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


def normalised(weights: Sequence[float]) -> list[float]:
    """Return positive ``weights`` scaled to sum to 1 (by the largest first, so that weights
    near the float limit do not overflow their sum)."""
    top = max(float(w) for w in weights)
    scaled = [float(w) / top for w in weights]
    total = math.fsum(scaled)
    return [w / total for w in scaled]


def data_hash(manifest: Manifest) -> str:
    """Return a prepared folder's identity: the sha256 of its manifest without the prepare's
    timings, the hpcllm version, the inputs as they were typed and the files' names, so the
    same data prepared again (elsewhere, by another version) hashes the same."""
    raw = dict(manifest.raw)
    for key in ("prepare", "created_by", "sources"):  # timings, version, inputs as typed
        raw.pop(key, None)
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
        weights = normalised([float(e[1]) for e in entries])
        sources = []
        for (path, _, name), weight in zip(entries, weights, strict=True):
            if not Path(path).exists():
                raise UserError(
                    f"data.blend source {name}: {path} does not exist; {make_data_hint(path)}"
                )
            try:
                manifest = load_manifest(path)
            except UserError as err:
                raise UserError(f"data.blend source {name}: {err}") from None
            sources.append(BlendSource(str(name), str(path), weight, manifest))
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

    def planned(
        self, samples: int, own_samples: Sequence[int], phase: Phase | None = None
    ) -> list[tuple[BlendSource, int, int, float]]:
        """Return, for each source, (source, its train samples (``own_samples``), samples it
        has given after the first ``samples`` of the stream (within one: its count at the
        ``phase``'s start plus ``w_i`` times the samples since, rounded), epochs of it)."""
        phase = (phase or Phase()).of(len(self.sources))
        rows = []
        for source, before, own in zip(self.sources, phase.before, own_samples, strict=True):
            drawn = before + round(source.weight * max(0, samples - phase.start))
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
        phase: Phase | None = None,
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
        check_position(consumed_samples, self.plan)
        self.phase = (phase or Phase()).of(len(blend.sources))
        if not 0 <= self.phase.start <= consumed_samples:
            raise ValueError(f"{self.phase} does not start by sample {consumed_samples}")
        if counts is None:
            counts = self._counts(consumed_samples, self.phase.start, self.phase.before)
        counts = [int(c) for c in counts]
        since = consumed_samples - self.phase.start
        if len(counts) != len(blend.sources) or sum(counts) - sum(self.phase.before) != since:
            raise ValueError(f"counts {counts} are no position at sample {consumed_samples}")
        self.consumed_samples = consumed_samples
        self.counts = counts
        # Positions the reader has passed (micro-step boundaries), for counts_at.
        self._lock = threading.Lock()
        self._passed: dict[int, tuple[int, ...]] = {consumed_samples: tuple(counts)}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def n_samples(self) -> list[int]:
        """Return each source's train samples."""
        return [d.n_samples for d in self.datasets]

    def _counts(self, consumed: int, at: int, counts: Sequence[int]) -> list[int]:
        """Return each source's count after ``consumed`` samples, going on from ``counts`` at
        sample ``at`` (both in this reader's phase)."""
        before = self.phase.before
        rel = [c - b for c, b in zip(counts, before, strict=True)]
        start = self.phase.start
        rel = self.blend.order.counts_at(consumed - start, at - start, rel)
        return [c + b for c, b in zip(rel, before, strict=True)]

    def counts_at(self, consumed: int) -> list[int]:
        """Return how many samples each source had given after ``consumed`` samples (from the
        nearest position the reader has passed at or before it)."""
        with self._lock:
            known = self._passed.get(consumed)
            below = [at for at in self._passed if at <= consumed]
            at = max(below) if below else None
            counts = self._passed[at] if at is not None else None
        if known is not None:
            return list(known)
        if at is None or counts is None:
            raise ValueError(f"sample {consumed} is before this reader's start")
        found = self._counts(consumed, at, counts)
        with self._lock:
            self._passed[consumed] = tuple(found)
        return found

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
        start, before = self.phase.start, self.phase.before
        while True:
            running = list(counts)
            rel = [c - x for c, x in zip(counts, before, strict=True)]
            sources = self.blend.order.take(consumed - start, rel, per_step).tolist()
            counts = [c + x for c, x in zip(rel, before, strict=True)]
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

        items = prefetched(self._batches(), self.prefetch)
        try:
            for tokens, consumed, counts in items:
                tokens = torch.from_numpy(tokens.astype(np.int64))
                self.consumed_samples, self.counts = consumed, list(counts)
                epoch = min(c // n for c, n in zip(counts, self.n_samples, strict=True))
                yield MicroBatch(tokens[:, :-1], tokens[:, 1:], epoch, consumed)
        finally:
            items.close()


class BlendPosition:
    """The blend's position as a named checkpoint part (``data_blend``): the consumed samples,
    each source's count there, where the blend's order began (its :class:`Phase`), and each
    source's name, folder, weight and data hash.

    ``consumed`` returns the run's consumed samples when a checkpoint is saved; the counts are
    the reader's at that point. Loading checks the saved sources against the blend's:

    - the same sources and weights go on where they were, exactly;
    - a source whose folder's data changed is refused in one line;
    - other weights, or sources added or left out, begin a new phase of the order at the
      checkpoint's sample, each source kept going on in its own order (:attr:`note` says so);
    - a checkpoint without the part (a run on one folder, an import) begins the blend there.
    """

    def __init__(self, blend: Blend, consumed: Callable[[], int]) -> None:
        self.blend = blend
        self.consumed = consumed
        self.reader: BlendedReader | None = None
        # Loaded: (consumed samples, counts, phase); None: the blend begins at the run's step.
        self.resumed: tuple[int, list[int], Phase] | None = None
        self.note: str | None = None  # what the trainer warns of a changed blend
        self._last: tuple[int, dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        consumed = self.consumed()
        if self._last is not None and self._last[0] == consumed:
            return self._last[1]  # meta() asks again, at the same save
        if self.reader is None:
            raise RuntimeError("the blend's position is saved once its reader is built")
        phase = self.reader.phase
        state = {
            "consumed_samples": consumed,
            "counts": self.reader.counts_at(consumed),
            "phase_start": phase.start,
            "phase_counts": list(phase.before),
            "sources": self.blend.describe(),
        }
        self._last = (consumed, state)
        return state

    def meta(self) -> dict[str, Any]:
        """Return what meta.json says of the position: the samples each source has given, and
        the sample where the blend's order began."""
        state = self.state_dict()
        return {
            "consumed_samples": state["consumed_samples"],
            "samples": dict(zip(self.blend.names, state["counts"], strict=True)),
            "phase_start": state["phase_start"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {s["name"]: s for s in state["sources"]}
        mine = self.blend.describe()
        for source in mine:
            then = saved.get(source["name"])
            if then is not None and then["hash"] != source["hash"]:
                raise UserError(
                    f"data.blend source {source['name']} ({source['path']}) is not the data the "
                    f"checkpoint drew from (its manifest changed since; it was {then['path']}): "
                    "a blend resumes only on its own data; restore that folder, or start "
                    "another run (run.dir)"
                )
        consumed = int(state["consumed_samples"])
        drawn = dict(zip(saved, (int(c) for c in state["counts"]), strict=True))
        counts = [drawn.get(s["name"], 0) for s in mine]
        same = list(saved) == [s["name"] for s in mine] and all(
            abs(saved[s["name"]]["weight"] - s["weight"]) <= 1e-9 for s in mine
        )
        if same:
            phase = Phase(int(state["phase_start"]), tuple(int(c) for c in state["phase_counts"]))
        else:
            phase = Phase(consumed, tuple(counts))
            then = ", ".join(f"{s['name']} {s['weight']:.4g}" for s in state["sources"])
            now = ", ".join(f"{s['name']} {s['weight']:.4g}" for s in mine)
            self.note = (
                f"data.blend differs from the checkpoint's (then {then}; now {now}): the "
                f"blend's order begins again at sample {consumed}, each source it kept going "
                "on in its own order"
            )
        self.resumed = (consumed, counts, phase)

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
        """Return the rank's reader from ``consumed_samples`` (the run's state), going on
        from the loaded position; without one, the blend's order begins there."""
        if self.resumed is not None:
            at, counts, phase = self.resumed
            if at != consumed_samples:
                raise UserError(
                    f"the checkpoint's blend position is at sample {at}, its step at "
                    f"{consumed_samples}: the checkpoint is not whole; resume an earlier one"
                )
        else:
            counts, phase = None, Phase(consumed_samples)
            if consumed_samples:
                self.note = (
                    "the checkpoint holds no blend position (its run read one folder, or was "
                    f"imported): the blend's order begins at sample {consumed_samples}"
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
            phase=phase,
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
    val split, or with one too small for one global micro-batch, is left out (``warn`` says
    so): its training needs one sample, its validation d x micro-batch."""
    readers = {}
    for source in blend.sources:
        if source.manifest.n_tokens("val") == 0:
            warn(
                f"data.blend source {source.name} has no validation split; the blended "
                "val_loss weighs the others"
            )
            continue
        try:
            reader = validation_reader(
                source.manifest,
                seq_len=seq_len,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=seed,
            )
        except UserError as err:  # too small for one global micro-batch: left out too
            warn(f"data.blend source {source.name} is left out of validation: {err}")
            continue
        readers[source.name] = (source.weight, reader)
    return readers


def blend_lines(blend: Blend, samples: int, reader: BlendedReader) -> list[str]:
    """Return the banner's lines of a blend: each source's weight, folder, train samples, and
    what the run's ``samples`` draw of it from ``reader``'s phase on (within one sample) and
    how many epochs that is."""
    phase = reader.phase
    rows = blend.planned(samples, reader.n_samples, phase)
    width = max(len(s.name) for s in blend.sources)
    began = f" (its order begun at sample {phase.start})" if phase.start else ""
    lines = [
        f"blend of {len(rows)} folder(s) (data.blend), one tokenizer; the run's {samples} "
        f"samples draw{began}:"
    ]
    for source, own, drawn, epochs in rows:
        lines.append(
            f"{source.name:<{width}}  weight {source.weight:.4f}  {drawn} samples, "
            f"{epochs:.2f} epochs of {own} ({source.path})"
        )
    return lines
