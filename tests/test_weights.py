"""WeightsState at world size 1: self-describing buffers, layout checks on pull, bad buffers."""

import json
import struct
from collections.abc import Callable

import pytest
import torch
from plane_helpers import fill
from torch import nn

from conduit_dist import SpecError
from conduit_dist.flow.weights import WeightsState, parts

PREAMBLE = struct.Struct("<4sII")  # magic, format, header length (the documented wire layout)


class Net(nn.Module):
    """Parameters and buffers of several dtypes: float, int64 (BatchNorm's counter), bool."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))


class Named(nn.Module):
    """State of a chosen set of names, shapes and dtypes."""

    def __init__(self, **state: torch.Tensor) -> None:
        super().__init__()
        for name, t in state.items():
            self.register_buffer(name, t.clone())


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, equal_nan=True, msg=k)


def published(module: nn.Module) -> WeightsState:
    ws = WeightsState()
    ws.publish(module)
    return ws


def test_pull_before_any_publish_returns_zero():
    assert WeightsState().pull(Net()) == 0


def test_pull_copies_every_tensor_of_the_same_architecture_exactly():
    a, b = fill(Net(), 0), fill(Net(), 1)
    ws = published(a)
    assert ws.version == 1 and ws.snapshot().nbytes == ws.buf.numel()
    assert ws.pull(b) == 1
    assert_same_state(a, b)
    fill(a, 2)
    ws.publish(a)
    assert ws.pull(b) == 2
    assert_same_state(a, b)


def test_round_trip_many_tensors_empty_and_nonfinite_values():
    def make() -> nn.Module:
        m = nn.Sequential(*(nn.Linear(2, 2) for _ in range(150)))  # 300 tensors
        m.register_buffer("empty", torch.zeros(0, 3))
        m.register_buffer("f16", torch.zeros(3, dtype=torch.float16))
        m.register_buffer("brain", torch.zeros(2, 2, dtype=torch.bfloat16))
        m.register_buffer("count", torch.zeros((), dtype=torch.int64))
        return m

    a, b = fill(make(), 0), fill(make(), 1)
    with torch.no_grad():
        a[0].weight[0, 0], a[1].bias[1] = float("nan"), float("inf")  # weights carry them as-is
    assert published(a).pull(b) == 1
    assert_same_state(a, b)


def assert_pull_rejected(ws, module: nn.Module, words: list[str]) -> None:
    """``ws.pull(module)`` raises a SpecError naming ``words`` and leaves ``module`` as it was."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(SpecError) as info:
        ws.pull(module)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    "src, dst, words",
    [
        # same bytes, transposed shapes
        (
            lambda: nn.Linear(4, 6, bias=False),
            lambda: nn.Linear(6, 4, bias=False),
            ["'weight'", "expected [4, 6] torch.float32", "received [6, 4] torch.float32"],
        ),
        # same bytes, other names
        (
            lambda: nn.Linear(4, 4),
            lambda: Named(w=torch.zeros(4, 4), b=torch.zeros(4)),
            ["missing", "'w'", "'b'", "unexpected", "'weight'", "'bias'"],
        ),
        # same bytes, other dtype
        (
            lambda: Named(x=torch.zeros(4), y=torch.zeros(2, 2)),
            lambda: Named(x=torch.zeros(4, dtype=torch.int32), y=torch.zeros(2, 2)),
            ["'x'", "expected [4] torch.int32", "received [4] torch.float32"],
        ),
        # other bytes (the learner's and the actor's net disagree)
        (
            lambda: nn.Linear(4, 6),
            lambda: nn.Linear(6, 4),
            ["'weight'", "'bias'", "expected [4] torch.float32", "received [6]", "bytes"],
        ),
    ],
)
def test_pull_rejects_another_layout_and_leaves_the_module_untouched(src, dst, words):
    assert_pull_rejected(published(fill(src(), 0)), fill(dst(), 1), words)


def rebuild(buf: torch.Tensor, edit: Callable[[dict], None]) -> torch.Tensor:
    """``buf`` with its JSON header edited (and re-padded), the payload kept."""
    raw = buf.numpy().tobytes()
    magic, fmt, hlen = PREAMBLE.unpack_from(raw)
    header = json.loads(raw[PREAMBLE.size : PREAMBLE.size + hlen])
    payload = raw[(PREAMBLE.size + hlen + 7) // 8 * 8 :]
    edit(header)
    text = json.dumps(header).encode()
    head = PREAMBLE.pack(magic, fmt, len(text)) + text
    head += b"\0" * (-len(head) % 8)
    return torch.frombuffer(bytearray(head + payload), dtype=torch.uint8)


def set_byte(at: int, value: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def corrupt(buf: torch.Tensor) -> torch.Tensor:
        buf = buf.clone()
        buf[at] = value
        return buf

    return corrupt


def edit_tensor(key: str, value: object) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(header: dict) -> None:
        header["tensors"][0][key] = value

    return lambda buf: rebuild(buf, edit)


@pytest.mark.parametrize(
    "corrupt, words",
    [
        (lambda b: b[:7].clone(), ["truncated", "7 bytes"]),
        (lambda b: b[:20].clone(), ["truncated", "header"]),
        (lambda b: b[:-4].clone(), ["truncated", "payload"]),
        (lambda b: torch.cat([b, torch.zeros(8, dtype=torch.uint8)]), ["payload", "bytes"]),
        (set_byte(0, ord("X")), ["not a conduit_dist weights buffer", "magic"]),
        (set_byte(4, 9), ["format", "9"]),
        (set_byte(10, 0x7F), ["truncated", "header"]),  # header length past the end
        (set_byte(PREAMBLE.size + 1, 0xFF), ["header", "JSON"]),
        (lambda b: rebuild(b, lambda h: h.update(tensors=7)), ["header", "tensors"]),
        (edit_tensor("offset", 1 << 40), ["'weight'", "outside the payload"]),
        (edit_tensor("offset", 3), ["'weight'", "offset"]),
        (edit_tensor("dtype", "object"), ["'weight'", "dtype", "'object'"]),
        (edit_tensor("shape", [-6, -4]), ["'weight'", "shape", "[-6, -4]"]),
        (edit_tensor("shape", "6x4"), ["'weight'", "shape", "'6x4'"]),
        (lambda b: rebuild(b, lambda h: h["tensors"][0].pop("dtype")), ["header", "dtype"]),
    ],
)
def test_pull_rejects_a_truncated_or_corrupted_buffer(corrupt, words):
    ws = published(fill(nn.Linear(4, 6), 0))
    ws.hold(ws.version, corrupt(ws.buf))
    assert_pull_rejected(ws, fill(nn.Linear(4, 6), 1), words)


@pytest.mark.parametrize("count", [2, 3, 7])
def test_learners_parts_put_together_are_the_whole_buffer_byte_for_byte(count):
    """Each learner packs only its part (tensors straddling a part's edge copied byte range by
    byte range); the parts side by side are the buffer one publisher packs, padding included,
    and the part ranges tile it."""
    a = fill(Net(), 0)
    whole = published(a).buf
    assert parts(whole.numel(), count)[-1][1] == whole.numel()
    stitched = torch.full_like(whole, 0xAB)
    for i, (lo, hi) in enumerate(parts(whole.numel(), count)):
        ws = WeightsState()
        ws.publish(a, part=(i, count))
        assert ws.whole() == (0, None) and ws.pull(Net()) == 0  # a part is never loaded
        stitched[lo:hi] = ws.buf[lo:hi]
    assert torch.equal(stitched, whole)
    with pytest.raises(SpecError, match=r"part: expected \(index, count\).*got \(2, 2\)"):
        WeightsState().publish(a, part=(2, 2))


def test_in_place_pull_loads_views_of_the_buffer_which_is_not_reused_while_held():
    from conduit_dist.records.buffers import use_count

    a, b = fill(Net(), 0), fill(Net(), 1)
    ws = published(a)
    grad = b.lin.weight.requires_grad
    assert ws.pull(b, in_place=True) == 1
    assert_same_state(a, b)
    assert b.lin.weight.untyped_storage().data_ptr() == ws.buf.untyped_storage().data_ptr()
    assert b.lin.weight.requires_grad == grad and isinstance(b.lin.weight, nn.Parameter)
    if use_count(torch.zeros(1)) is None:
        return
    held = ws.buf.untyped_storage().data_ptr()
    for v in range(2, 5):  # later versions never go into the buffer b reads
        fill(a, v)
        ws.publish(a)
        assert ws.buf.untyped_storage().data_ptr() != held
    assert b.lin.weight.untyped_storage().data_ptr() == held
    torch.testing.assert_close(b.lin.weight, fill(Net(), 0).lin.weight, rtol=0, atol=0)


def test_bucket_bytes_must_be_a_positive_multiple_of_eight():
    for bad in (3, 12, -8):
        with pytest.raises(SpecError, match=f"bucket_bytes.*multiple of 8, got {bad}"):
            WeightsState(bucket_bytes=bad)


def test_publish_rejects_a_module_without_state():
    with pytest.raises(SpecError, match="got none"):
        WeightsState().publish(nn.ReLU())


def test_publishing_reuses_buffers_nobody_holds_and_never_writes_a_held_one():
    """A steady publisher allocates nothing; a round's snapshot (or a pull in progress) keeps
    its buffer: later versions go elsewhere, and every buffer is byte for byte what a fresh
    one of its version would be (padding zeroed too)."""
    from conduit_dist.bench.rounds import TensorAllocations
    from conduit_dist.records.buffers import use_count

    if use_count(torch.zeros(1)) is None:
        pytest.skip("this torch exposes no storage use counts: every version gets a new buffer")
    net, other = fill(Net(), 0), fill(Net(), 1)
    ws = WeightsState()
    ws.publish(net)
    held = ws.snapshot()  # a round in flight holds version 1
    kept = held.buf.clone()
    for v in range(2, 6):
        with torch.no_grad():
            net.lin.weight.add_(1.0)
        ws.publish(net)
        assert ws.buf.data_ptr() != held.buf.data_ptr()
        fresh = WeightsState()
        fresh.publish(net)
        assert torch.equal(ws.buf, fresh.buf), v  # a reused buffer is a fresh one's bytes
    assert torch.equal(held.buf, kept)  # never written while held
    del held
    seen = set()
    with TensorAllocations() as allocs:
        for _ in range(6):
            ws.publish(net)
            seen.add(ws.buf.data_ptr())
            assert ws.pull(other) == ws.version
    assert allocs.count == 0 and len(seen) <= 3, (allocs.count, len(seen))
    assert_same_state(net, other)


def test_weights_buffers_follow_a_layout_change_and_a_receiver_reuses_its_own():
    """After the layout shrinks, the pool's free buffers of the old size leave it and publishing
    allocates nothing again; a receiver's buffers (written by a broadcast) are reused the same
    way, and each pull decodes the buffer it copies from, also at the same address."""
    from conduit_dist.bench.rounds import TensorAllocations
    from conduit_dist.records.buffers import use_count

    if use_count(torch.zeros(1)) is None:
        pytest.skip("this torch exposes no storage use counts")
    big, small = nn.Linear(40, 40), nn.Linear(3, 2)
    ws = WeightsState()
    for _ in range(3):
        ws.publish(big)
    for _ in range(3):
        ws.publish(small)
    with TensorAllocations() as allocs:
        for _ in range(5):
            ws.publish(small)
    assert allocs.count == 0
    receiver, target = WeightsState(), nn.Linear(3, 2)
    for v in range(1, 8):  # what exchange does on a receiver: a taken buffer, then current
        with torch.no_grad():
            small.weight.fill_(float(v))
        ws.publish(small)
        buf = receiver._buffers.take(ws.buf.numel())
        buf.copy_(ws.buf)  # the broadcast
        receiver.hold(v, buf)
        del buf
        assert receiver.pull(target) == v
        assert torch.equal(target.weight, small.weight)
    assert len(receiver._buffers._pool) <= 3


def test_device_weights_read_their_header_once_per_layout_and_check_its_digest():
    """Device buffers (a CUDA token plane's; a host "device" here): a receiver loads a version
    with no host read when it knows the header's digest, reads the header once per new
    layout (counted), and refuses a buffer whose header is not the one announced."""
    from conduit_dist.flow.weights import WeightsState
    from conduit_dist.syncs import SYNCS

    cpu = torch.device("cpu")
    pub, recv = WeightsState(cpu), WeightsState(cpu)
    net, copy = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = SYNCS.snapshot().get("weights header", 0)
    for _ in range(3):  # three versions of one layout
        pub.publish(net)
        snap = pub.snapshot()
        recv.hold(snap.version, snap.buf.clone(), snap.head)
        assert recv.pull(copy) == snap.version
        assert torch.equal(copy.weight, net.weight)
        with torch.no_grad():
            net.weight.add_(1.0)
    assert SYNCS.snapshot().get("weights header", 0) == before + 1  # the first pull only
    pub.publish(net)
    recv.hold(pub.version, pub.snapshot().buf.clone(), 12345)
    with pytest.raises(SpecError, match="differs from the one the publisher announced"):
        recv.pull(copy)


class _Transport:
    """What ``WeightsState.routes`` reads of a plane's transport: its topology, link classes
    and bandwidth models (declared: a fast host link, a slow network one)."""

    def __init__(self, hosts: list[str], net_gbps: float = 1.0) -> None:
        from conduit_dist.collectives.model import BandwidthModel
        from conduit_dist.collectives.topology import Topology

        self.topo = Topology.from_hosts(hosts)
        self.links = self.topo.link_matrix()
        self.model = BandwidthModel.declared(20e-6, {"self": 50.0, "host": 20.0, "net": net_gbps})
        self.device_model = self.model


def _delivered(phases, receivers) -> dict[int, set[tuple[int, int]]]:
    """The parts each receiver ends up holding, following the routes phase by phase (a rank
    forwards only a part it held before the phase)."""
    held: dict[int, set[tuple[int, int]]] = {r: set() for r in receivers}
    for phase in phases:
        arrived: dict[int, set[tuple[int, int]]] = {r: set() for r in receivers}
        for src, dst, lo, hi in phase:
            if src in held:
                assert (lo, hi) in held[src], (src, lo, hi)
            arrived[dst].add((lo, hi))
        for r in receivers:
            held[r] |= arrived[r]
    return held


def test_routes_relay_each_part_once_over_a_slow_link_and_go_straight_on_one_host():
    ws, nbytes = WeightsState(), 64 << 20  # priced, not moved: large enough for bytes to count
    ranges = parts(nbytes, 2)
    owned = [[r] for r in ranges]  # one range per owner (a sharded state: several)
    ws.transport = _Transport(["a", "a", "b", "b"])  # learners on a, producers on b
    schedule, phases = ws.routes([0, 1], owned, [2, 3])
    assert schedule == "relay" and len(phases) == 2
    first, second = phases
    assert sorted(first) == [(0, 2, *ranges[0]), (1, 3, *ranges[1])]  # each part once
    assert sorted(second) == [(2, 3, *ranges[0]), (3, 2, *ranges[1])]  # passed on inside b
    assert all(h == set(ranges) for h in _delivered(phases, [2, 3]).values())
    link = ws.transport.links
    over_net = sum(hi - lo for p in phases for s, d, lo, hi in p if link[s, d] == link[0, 2])
    assert over_net == nbytes  # the model once over the link (direct: twice)

    ws.transport = _Transport(["a"] * 4)  # one host: nothing to relay
    assert ws.routes([0, 1], owned, [2, 3]) == (
        "p2p", [[(0, 2, *ranges[0]), (0, 3, *ranges[0]), (1, 2, *ranges[1]), (1, 3, *ranges[1])]]
    )  # fmt: skip
    ws.transport = _Transport(["a", "b", "a", "b"])  # an owner on every host: straight
    assert ws.routes([0, 1], owned, [2, 3])[0] == "p2p"
    ws.transport = None  # no transport known: straight
    assert ws.routes([0, 1], owned, [2, 3])[0] == "p2p"


def test_routes_relay_every_range_of_a_sharded_state_once_over_the_slow_link():
    ws, mb = WeightsState(), 1 << 20
    shards = [[(0, 8 * mb), (16 * mb, 24 * mb)], [(8 * mb, 16 * mb), (24 * mb, 40 * mb)]]
    ws.transport = _Transport(["a", "a", "b", "b"])
    schedule, phases = ws.routes([0, 1], shards, [2, 3])
    assert schedule == "relay"
    held = _delivered(phases, [2, 3])
    assert all(h == {r for rs in shards for r in rs} for h in held.values())
    link = ws.transport.links
    over_net = sum(hi - lo for p in phases for s, d, lo, hi in p if link[s, d] == link[0, 2])
    assert over_net == 40 * mb


@pytest.mark.parametrize(
    ("ranges", "words"),
    [
        ([[[0, 8]], [[16, 24]]], "after byte 8"),  # a gap
        ([[[0, 16]], [[8, 24]]], "after byte 16"),  # an overlap
        ([[[0, 8]], [[8, 16]]], "cover 16 of the 24-byte payload"),  # short
        ([[[0, 8], [8, 16]]], "one list of ranges per holder"),
        ([[[0, 8]], [[8, "24"]]], "expected [[lo, hi], ...] per holder"),
    ],
)
def test_a_sharded_header_must_cover_its_payload_once_between_its_holders(ranges, words):
    from conduit_dist.flow.weights_format import (
        Shards,
        decode,
        entries_of,
        header_of,
    )

    entries = entries_of({"a": torch.zeros(2, 3, dtype=torch.float32)})  # 24 payload bytes
    good = Shards((0, 1), (((0, 16),), ((16, 24),)))
    head, total = header_of(entries, good)
    assert decode(head, total).shards == good
    desc = json.loads(head[12:])
    desc["shards"]["ranges"] = ranges
    raw = json.dumps(desc).encode()
    bad = struct.pack("<4sII", b"CDWT", 1, len(raw)) + raw
    size = -(-len(bad) // 8) * 8 + 24
    with pytest.raises(SpecError, match="corrupted header: shards") as e:
        decode(bad, size)
    assert words in str(e.value)
