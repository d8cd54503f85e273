"""The baselines the benchmarks and ``plane.kind=simple`` compare against, and the benches' flags.

A ring buffer that is off by one at the wrap drops or duplicates an item there; each test below
checks the exact set (and order) of items held after every insert, not only the final count.
"""

from __future__ import annotations

import collections

import pytest
import torch

import conduit_dist as cd
from conduit_dist.bench import latency, ppo, store
from conduit_dist.rl.buffers import SimpleBuffer

# batch sizes that land on the end of the buffer exactly (3 + 4 + 3 = 10), wrap mid-batch,
# fill it in one go, and exceed it (23 > 10: only the newest 10 of that batch stay)
SIZES = [3, 4, 3, 1, 9, 7, 10, 2, 23, 5, 6]
CAPACITY = 10


def rows(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch whose every field is a function of the item's id."""
    return {
        "id": ids.clone(),
        "obs": ids.float().view(-1, 1) * torch.tensor([1.0, -2.0, 0.5]),
        "action": ids % 6,
        "done": ids % 3 == 0,
    }


def assert_rows_consistent(batch: dict[str, torch.Tensor]) -> None:
    """Each field of each row belongs to the same item (no field read from another slot)."""
    ids = batch["id"]
    for k, v in rows(ids).items():
        assert torch.equal(batch[k], v), k


class SimpleAdapter:
    """SimpleBuffer under the bench stores' ``insert`` / ``sample`` names."""

    def __init__(self, example, capacity):
        self.buf = SimpleBuffer(example, capacity, seed=3)

    def __len__(self):
        return len(self.buf)

    def insert(self, batch):
        self.buf.put(batch)
        self.buf.flush()

    def sample(self, n):
        return self.buf.fetch(n)

    @property
    def data(self):
        return self.buf.data

    @property
    def pos(self):
        return self.buf.pos


RINGS = [SimpleAdapter, store.RingStore, store.RingOutStore]


def fill_and_check(ring, sizes: list[int]) -> collections.deque:
    """Insert consecutive ids in batches of ``sizes``; after each, the ring holds the newest."""
    expected: collections.deque = collections.deque(maxlen=CAPACITY)
    next_id = 0
    for n in sizes:
        if n > CAPACITY and not isinstance(ring, SimpleAdapter):
            continue  # the bench's rings take batches up to their capacity (checked at parse)
        ids = torch.arange(next_id, next_id + n)
        ring.insert(rows(ids))
        expected.extend(ids.tolist())
        next_id += n
        assert len(ring) == len(expected)
        held = ring.data["id"][: len(expected)]
        assert sorted(held.tolist()) == sorted(expected)
        # FIFO order: reading from the write position on gives oldest to newest
        if len(expected) == CAPACITY:
            order = torch.cat([ring.data["id"][ring.pos :], ring.data["id"][: ring.pos]])
            assert order.tolist() == list(expected)
        assert_rows_consistent({k: v[: len(expected)] for k, v in ring.data.items()})
    return expected


@pytest.mark.parametrize("ring_cls", RINGS, ids=lambda c: c.__name__)
def test_ring_keeps_newest_capacity_items_across_wraps(ring_cls):
    ring = ring_cls(rows(torch.arange(2)), CAPACITY)
    expected = fill_and_check(ring, SIZES)
    held = set(expected)
    seen = set()
    for n in (1, 7, 500):
        batch = ring.sample(n)
        assert batch["id"].shape == (n,)
        assert set(batch["id"].tolist()) <= held
        assert_rows_consistent(batch)
        seen |= set(batch["id"].tolist())
    assert seen == held  # every slot is drawn: no bound one short of the size


def test_simple_buffer_partial_fill_samples_only_written_rows():
    buf = SimpleBuffer(rows(torch.arange(2)), CAPACITY, seed=0)
    with pytest.raises(cd.EmptyStoreError):
        buf.fetch(4)
    buf.put(rows(torch.arange(100, 104)))
    batch = buf.fetch(400)
    assert set(batch["id"].tolist()) == {100, 101, 102, 103}
    assert_rows_consistent(batch)


def test_simple_buffer_sampling_is_seeded():
    a, b = (SimpleBuffer(rows(torch.arange(2)), CAPACITY, seed=5) for _ in range(2))
    for buf in (a, b):
        buf.put(rows(torch.arange(12)))
    assert torch.equal(a.fetch(32)["id"], b.fetch(32)["id"])


def test_ring_out_reuses_its_outputs():
    ring = store.RingOutStore(rows(torch.arange(2)), CAPACITY)
    ring.insert(rows(torch.arange(10)))
    first = ring.sample(8)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    second = ring.sample(8)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    assert_rows_consistent(second)


def test_conduit_insert_makes_its_items_sampleable():
    """The insert cell counts put + the round: on return, a fetch draws the new items."""
    conduit = store.ConduitStore(rows(torch.arange(2)), 16)
    try:
        conduit.insert(rows(torch.arange(5)))
        assert len(conduit) == 5
        batch = conduit.sample(64)
        assert set(batch["id"].tolist()) == set(range(5))
        conduit.insert(rows(torch.arange(5, 25)))  # wraps: 16 newest of 25 remain
        assert len(conduit) == 16
        assert set(conduit.sample(400)["id"].tolist()) == set(range(9, 25))
    finally:
        conduit.close()


def test_store_summary_takes_the_faster_ring():
    base = {"transition": "small", "batch": 256}
    rows_ = [
        {**base, "op": "sample", "system": "conduit", "items_per_s": 100.0},
        {**base, "op": "sample", "system": "ring_fresh", "items_per_s": 50.0},
        {**base, "op": "sample", "system": "ring_out", "items_per_s": 200.0},
        {**base, "op": "insert", "system": "conduit", "items_per_s": 90.0},
        {**base, "op": "insert", "system": "ring_fresh", "items_per_s": 100.0},
        {**base, "op": "insert", "system": "ring_out", "items_per_s": 60.0},
    ]
    ratios, summary = store.summarize(rows_)
    sample = next(e for e in ratios if e["op"] == "sample")
    assert sample["vs_ring_fresh"] == 2.0 and sample["vs_ring_out"] == 0.5
    assert sample["vs_ring"] == 0.5
    assert summary["min_vs_ring"] == 0.5
    assert summary["min_vs_ring_fresh"] == 0.9
    assert summary["by_op"]["insert"]["min_vs_ring"] == 0.9
    assert summary["min_vs_torchrl"] is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--batches", "0"], "--batches"),
        (["--min-time", "-1"], "--min-time"),
        (["--repeats", "two"], "--repeats"),
        (["--scale", "0.01", "--batches", "9000"], "--batches"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_store_rejects_bad_flags_at_parse_time(argv, flag, capsys):
    with pytest.raises(SystemExit):
        store.parse_args(argv)
    err = capsys.readouterr().err
    assert flag in err and "expected" in err and "got" in err


@pytest.mark.parametrize(
    "argv, flag, received",
    [
        (["--out", "x.json"], "--out", "x.json"),
        (["--iters", "0"], "--iters", "0"),
        (["--batch", "-4"], "--batch", "-4"),
        (["--ratio", "0"], "--ratio", "0"),
        (["--features", "30000"], "--features", "30000"),
        (["--dqn-iters", "5"], "--dqn-iters", "5"),
    ],
)
def test_latency_rejects_bad_flags_at_parse_time(argv, flag, received, capsys):
    with pytest.raises(SystemExit):
        latency.parse_args(argv)
    err = capsys.readouterr().err
    assert flag in err and "expected" in err and received in err


def test_latency_defaults_parse(tmp_path):
    a = latency.parse_args(["--out", str(tmp_path / "p.png"), "--dqn-iters", "0"])
    assert a.out.endswith("p.png") and a.dqn_iters == 0


@pytest.mark.parametrize(
    "argv, flag, received",
    [
        (["--items", "8"], "--items", "8"),
        (["--iters", "1"], "--iters", "1"),
        (["--compute-ms", "-1"], "--compute-ms", "-1"),
        (["--items", "100", "--minibatches", "8"], "--items", "100"),
    ],
)
def test_ppo_bench_rejects_bad_flags_at_parse_time(argv, flag, received, capsys):
    with pytest.raises(SystemExit):
        ppo.parse_args(argv)
    err = capsys.readouterr().err
    assert flag in err and "expected" in err and received in err
