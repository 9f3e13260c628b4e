import multiprocessing

import numpy as np
import pytest
import torch
from datasets_fixtures import full_stream, prepare_corpus

from hpcllm.datasets.reader import (
    MicroBatchReader,
    ShardDataset,
    epoch_permutation,
    rank_samples,
)
from hpcllm.errors import UserError

SEQ = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    # Four shards, so many windows straddle a shard boundary.
    prepare_corpus(root / "src", root / "out", tokenizer="byte", val_fraction=0.1, shards=4)
    return root / "out"


def _take(reader, n):
    batches = iter(reader)
    out = [next(batches) for _ in range(n)]
    batches.close()
    return out


def test_windows_are_the_stream_shifted_by_one(data):
    stream = full_stream(data).astype(np.int64)
    dataset = ShardDataset(data, "train", SEQ)
    assert len(dataset) == (len(stream) - 1) // SEQ
    for index in [0, 1, len(dataset) // 2, len(dataset) - 1]:
        item = dataset[index]
        window = torch.from_numpy(stream[index * SEQ : index * SEQ + SEQ + 1])
        assert torch.equal(item["input_ids"], window[:-1])
        assert torch.equal(item["labels"], window[1:])


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_the_epoch(data, dp_size):
    b = 3
    readers = [
        MicroBatchReader(data, seq_len=SEQ, micro_batch_size=b, dp_rank=r, dp_size=dp_size, seed=7)
        for r in range(dp_size)
    ]
    n = readers[0].dataset.n_samples
    steps = readers[0].steps_per_epoch
    assert steps == n // (dp_size * b)
    stream = full_stream(data).astype(np.int64)
    order = epoch_permutation(n, seed=7, epoch=0)
    seen = []
    for rank, reader in enumerate(readers):
        batches = _take(reader, steps)
        for step, batch in enumerate(batches):
            expected = rank_samples(order, step, rank, dp_size, b)
            assert len(expected) == b
            for row, k in enumerate(expected):
                window = stream[k * SEQ : k * SEQ + SEQ + 1]
                assert np.array_equal(batch.input_ids[row].numpy(), window[:-1])
                assert np.array_equal(batch.labels[row].numpy(), window[1:])
            seen += list(expected)
            assert batch.epoch == 0
            assert batch.consumed_samples == (step + 1) * dp_size * b
    assert len(seen) == len(set(seen)), "ranks overlap"
    dropped = set(range(n)) - set(seen)
    assert set(seen) == set(order[: steps * dp_size * b].tolist())
    assert len(dropped) == n % (dp_size * b) < dp_size * b


def test_shuffle_is_deterministic_and_changes_per_epoch(data):
    a = MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, seed=3)
    b = MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, seed=3)
    c = MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, seed=4)
    steps = a.steps_per_epoch
    first, second, other = _take(a, 2 * steps), _take(b, 2 * steps), _take(c, steps)
    same = lambda xs, ys: all(
        torch.equal(x.input_ids, y.input_ids) for x, y in zip(xs, ys, strict=True)
    )
    assert same(first, second)
    assert not same(first[:steps], other)
    assert first[steps].epoch == 1
    epoch0 = torch.cat([x.input_ids for x in first[:steps]])
    epoch1 = torch.cat([x.input_ids for x in first[steps:]])
    assert not torch.equal(epoch0, epoch1)
    # Same multiset of samples in both epochs when nothing is dropped.
    if a.samples_per_epoch == a.dataset.n_samples:
        assert sorted(map(tuple, epoch0.tolist())) == sorted(map(tuple, epoch1.tolist()))


@pytest.mark.parametrize("k", [1, 5, "epoch-1", "epoch+2"])
def test_resume_from_consumed_samples_equals_the_continuous_stream(data, k):
    kwargs = dict(seq_len=SEQ, micro_batch_size=2, dp_rank=1, dp_size=2, seed=11)
    continuous = MicroBatchReader(data, **kwargs)
    steps = continuous.steps_per_epoch
    k = {"epoch-1": steps - 1, "epoch+2": steps + 2}.get(k, k)
    stream = _take(continuous, k + 6)
    resumed = MicroBatchReader(data, consumed_samples=stream[k - 1].consumed_samples, **kwargs)
    for expected, got in zip(stream[k:], _take(resumed, 6), strict=True):
        assert torch.equal(expected.input_ids, got.input_ids)
        assert torch.equal(expected.labels, got.labels)
        assert (expected.epoch, expected.consumed_samples) == (got.epoch, got.consumed_samples)


def test_resume_position_must_be_a_global_step(data):
    with pytest.raises(UserError, match="not a multiple of the global micro-batch 4"):
        MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, dp_size=2, consumed_samples=6)


def test_ranks_that_share_a_dp_rank_read_the_same(data):
    # tp or pp peers build their reader from the same (dp_rank, dp_size, seed).
    one = _take(MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, dp_rank=1, dp_size=3), 4)
    two = _take(MicroBatchReader(data, seq_len=SEQ, micro_batch_size=2, dp_rank=1, dp_size=3), 4)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(one, two, strict=True))


def test_validation_split_reads(data):
    stream = full_stream(data, "val").astype(np.int64)
    dataset = ShardDataset(data, "val", SEQ)
    assert torch.equal(dataset[0]["input_ids"], torch.from_numpy(stream[:SEQ]))


def test_dataloader_workers_after_fork(data):
    dataset = ShardDataset(data, "train", SEQ)
    direct = [dataset[i]["input_ids"] for i in range(len(dataset))]  # opens files in parent
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        shuffle=False,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    loaded = torch.cat([batch["input_ids"] for batch in loader])
    assert torch.equal(loaded, torch.stack(direct))


def test_too_little_data_for_one_global_micro_batch(data):
    with pytest.raises(UserError, match="fewer than one global micro-batch"):
        MicroBatchReader(data, seq_len=SEQ, micro_batch_size=10_000, dp_size=4)
