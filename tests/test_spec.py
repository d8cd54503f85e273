"""ExperienceSpec: inference, layout, validation errors, pack/unpack round trip."""

import pytest
import torch

from conduit_dist import ExperienceSpec, FieldSpec, SpecError


def small_batch(n: int = 6) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.randn(n, 3, 2),
        "action": torch.arange(n),
        "reward": torch.randn(n),
        "done": torch.rand(n) > 0.5,
        "img": torch.randint(0, 255, (n, 5), dtype=torch.uint8),
        "half": torch.randn(n, 3).half(),
    }


def test_from_batch_infers_fields_and_aligned_layout():
    spec = ExperienceSpec.from_batch(small_batch())
    assert spec.fields["obs"].shape == (3, 2) and spec.fields["obs"].dtype == torch.float32
    assert spec.fields["action"].shape == () and spec.fields["done"].dtype == torch.bool
    assert spec.record_bytes % 8 == 0
    assert all(off % 8 == 0 for off in spec.offsets.values())
    assert spec.record_bytes >= spec.payload_bytes


def test_explicit_constructor_matches_inferred():
    b = small_batch()
    explicit = ExperienceSpec({k: (tuple(v.shape[1:]), v.dtype) for k, v in b.items()})
    assert explicit == ExperienceSpec.from_batch(b)


def test_pack_unpack_round_trip_every_field():
    b = small_batch(7)
    spec = ExperienceSpec.from_batch(b)
    rec = spec.empty_records(7)
    spec.validate(b)
    spec.pack(b, rec)
    out = spec.unpack(rec)
    for k, v in b.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda b: b.pop("reward"), ["missing ['reward']"]),
        (lambda b: b.update(extra=torch.zeros(6)), ["unexpected ['extra']"]),
        (lambda b: b.update(action=b["action"].int()), ["'action'", "torch.int64", "torch.int32"]),
        (lambda b: b.update(obs=torch.randn(6, 2, 3)), ["'obs'", "[B, 3, 2]", "[6, 2, 3]"]),
        (lambda b: b.update(reward=torch.randn(5)), ["'reward'", "5", "6"]),
        (lambda b: b.update(action=[1, 2]), ["'action'", "torch.Tensor", "list"]),
    ],
)
def test_validation_names_field_expected_and_received(mutate, words):
    b = small_batch()
    spec = ExperienceSpec.from_batch(b)
    mutate(b)
    with pytest.raises(SpecError) as info:
        spec.validate(b)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_empty_batch_rejected():
    b = small_batch()
    spec = ExperienceSpec.from_batch(b)
    with pytest.raises(SpecError, match="empty"):
        spec.validate({k: v[:0] for k, v in b.items()})


@pytest.mark.parametrize("field", ["obs", "reward", "half"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_named_unless_allowed(field, bad):
    b = small_batch()
    b[field].view(-1)[3] = bad
    spec = ExperienceSpec.from_batch(b)
    with pytest.raises(SpecError, match=f"'{field}'.*1 NaN/inf"):
        spec.check_finite(b)
    with pytest.raises(SpecError, match=f"'{field}'.*1 NaN/inf"):  # fused into the copy
        spec.pack(b, spec.empty_records(6), check=True)
    allowed = ExperienceSpec.from_batch(b, allow_nonfinite=True)
    allowed.check_finite(b)
    rec = allowed.empty_records(6)
    allowed.pack(b, rec, check=True)
    assert torch.allclose(allowed.unpack(rec)[field], b[field], equal_nan=True)


def test_finite_values_whose_sum_overflows_are_accepted():
    b = {"x": torch.full((4, 2), 3e38)}
    ExperienceSpec.from_batch(b).check_finite(b)  # overflowing sum, exact re-check: no error


def test_bad_spec_definitions():
    with pytest.raises(SpecError, match="at least one field"):
        ExperienceSpec({})
    with pytest.raises(SpecError, match="dtype"):
        FieldSpec("x", (1,), torch.complex64)
    with pytest.raises(SpecError, match="shape must be positive"):
        FieldSpec("x", (0,), torch.float32)
    with pytest.raises(SpecError, match="leading batch dim"):
        ExperienceSpec.from_batch({"x": torch.tensor(1.0)})


def test_pack_handles_non_contiguous_fields():
    b = small_batch(5)
    b["obs"] = torch.randn(5, 2, 3).transpose(1, 2)  # [5, 3, 2], not contiguous
    b["reward"] = torch.randn(10)[::2]
    spec = ExperienceSpec.from_batch(b)
    rec = spec.empty_records(5)
    spec.pack(b, rec)
    out = spec.unpack(rec)
    for k, v in b.items():
        assert torch.equal(out[k], v), k


def _misaligned_records(spec: ExperienceSpec, n: int) -> torch.Tensor:
    """``uint8 [n, record_bytes]`` rows whose first byte sits at an odd address."""
    flat = torch.zeros(n * spec.record_bytes + 1, dtype=torch.uint8)[1:]
    return flat.view(n, spec.record_bytes)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda b: b.update(reward=b["reward"][:5]), ["'reward'", "5", "6"]),
        (lambda b: b.update(action=b["action"].int()), ["'action'", "torch.int64", "torch.int32"]),
        (lambda b: b.update(obs=torch.randn(6, 2, 3)), ["'obs'", "[B, 3, 2]", "[6, 2, 3]"]),
        (lambda b: b.update(obs=torch.randn(6, 3, 4)), ["'obs'", "[B, 3, 2]", "[6, 3, 4]"]),
        (lambda b: b.pop("img"), ["missing ['img']"]),
        (lambda b: b.update(done=[True] * 6), ["'done'", "torch.Tensor", "list"]),
        (lambda b: b.update({k: v[:5] for k, v in b.items()}), ["out", "5", "6"]),
    ],
)
def test_pack_rejects_batch_that_does_not_match_spec_or_out(mutate, words):
    b = small_batch()
    spec = ExperienceSpec.from_batch(b)
    mutate(b)
    for check in (False, True):
        with pytest.raises(SpecError) as info:
            spec.pack(b, spec.empty_records(6), check=check)
        for w in words:
            assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize(
    "make_out, words",
    [
        (lambda r: torch.empty(6, r, dtype=torch.float32), ["out", "torch.uint8", "torch.float32"]),
        (lambda r: torch.empty(6, r + 8, dtype=torch.uint8), ["out", "record_bytes", "[6, "]),
        (lambda r: torch.empty(6, r - 8, dtype=torch.uint8), ["out", "record_bytes", "[6, "]),
        (lambda r: torch.empty(6 * r, dtype=torch.uint8), ["out", "2-D", "1-D"]),
        (lambda r: torch.empty(6, 2 * r, dtype=torch.uint8)[:, :r], ["out", "stride"]),
        (lambda r: torch.empty(r, 6, dtype=torch.uint8).t(), ["out", "stride"]),
        (lambda r: [bytearray(r)] * 6, ["out", "torch.Tensor", "list"]),
    ],
)
def test_pack_rejects_out_of_the_wrong_dtype_shape_or_stride(make_out, words):
    b = small_batch()
    spec = ExperienceSpec.from_batch(b)
    with pytest.raises(SpecError) as info:
        spec.pack(b, make_out(spec.record_bytes))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_pack_into_misaligned_rows_matches_aligned_and_scans_in_place():
    b = small_batch(5)
    spec = ExperienceSpec.from_batch(b)
    aligned = torch.zeros(5, spec.record_bytes, dtype=torch.uint8)  # padding compared too
    odd = _misaligned_records(spec, 5)
    spec.pack(b, aligned, check=True)
    spec.pack(b, odd, check=True)
    assert odd.data_ptr() % 2 == 1 and torch.equal(odd, aligned)
    spec.check_records_finite(odd)
    b["half"][2, 1] = float("nan")
    with pytest.raises(SpecError, match="'half'.*1 NaN/inf"):
        spec.pack(b, odd, check=True)
    spec.pack(b, odd)
    with pytest.raises(SpecError, match="'half'"):
        spec.check_records_finite(odd)


def test_check_records_finite_rejects_records_of_the_wrong_layout():
    b = small_batch()
    spec = ExperienceSpec.from_batch(b)
    with pytest.raises(SpecError, match=r"records.*torch\.uint8.*torch\.float32"):
        spec.check_records_finite(torch.zeros(6, spec.record_bytes, dtype=torch.float32))
    with pytest.raises(SpecError, match="records.*record_bytes"):
        spec.check_records_finite(torch.zeros(6, spec.record_bytes - 8, dtype=torch.uint8))


def test_spec_with_more_fields_than_the_native_table_still_packs():
    b = {f"f{i}": torch.full((3,), float(i)) for i in range(300)}
    spec = ExperienceSpec.from_batch(b)
    rec = spec.empty_records(3)
    spec.pack(b, rec, check=True)
    out = spec.unpack(rec)
    assert all(torch.equal(out[k], v) for k, v in b.items())


native = pytest.importorskip("conduit_dist._native._pack", reason="native packing not built")


@pytest.mark.parametrize(
    "call",
    [
        # field start + size past the record, and a sum that overflows 64 bits
        lambda: native.pack_rows(0, 8, 0, (0,), (16,), (0,), (0,)),
        lambda: native.pack_rows(0, 8, 0, (0,), (2**62,), (2**62,), (0,)),
        lambda: native.rows_nonfinite(0, 8, 0, (2**62,), (2**62,), (4,)),
        # negative counts and sizes
        lambda: native.pack_rows(0, 8, -1, (), (), (), ()),
        lambda: native.pack_rows(0, -8, 0, (), (), (), ()),
        lambda: native.any_nonfinite(0, -1, 4),
        # a float kind whose size is not a whole number of its values
        lambda: native.pack_rows(0, 8, 0, (0,), (6,), (0,), (4,)),
    ],
)
def test_native_rejects_fields_outside_the_record(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: native.pack_rows(0, 2**40, 2**40, (), (), (), ()),  # n * row_bytes
        lambda: native.pack_rows(0, 2**32, 2**32, (0,), (8,), (0,), (0,)),
        lambda: native.rows_nonfinite(0, 2**40, 2**40, (), (), ()),
        lambda: native.any_nonfinite(0, 2**62, 4),  # n * 4 wraps to 0
    ],
)
def test_native_rejects_sizes_whose_products_overflow(call):
    with pytest.raises(OverflowError):
        call()


def test_native_scans_misaligned_floats():
    for dtype, kind in [(torch.float32, 4), (torch.float64, 8), (torch.float16, 2)]:
        vals = torch.arange(37, dtype=dtype)
        raw = torch.zeros(vals.numel() * vals.element_size() + 1, dtype=torch.uint8)
        raw[1:].copy_(vals.view(torch.uint8))
        assert raw.data_ptr() % 2 == 0
        assert not native.any_nonfinite(raw.data_ptr() + 1, vals.numel(), kind)
        vals[-1] = float("inf")
        raw[1:].copy_(vals.view(torch.uint8))
        assert native.any_nonfinite(raw.data_ptr() + 1, vals.numel(), kind)


def test_a_pack_larger_than_the_caches_streams_and_still_checks():
    """Above 64 MiB of destination the native pack writes with non-temporal stores."""
    n = 1100
    spec = ExperienceSpec({"frame": ((65_536,), torch.uint8), "r": ((), torch.float32)})
    assert n * spec.record_bytes >= 64 << 20
    batch = {
        "frame": torch.randint(0, 256, (n, 65_536), dtype=torch.uint8),
        "r": torch.arange(n, dtype=torch.float32),
    }
    out = torch.empty(n, spec.record_bytes, dtype=torch.uint8)
    spec.pack(batch, out, check=True)
    view = spec.unpack(out)
    assert torch.equal(view["frame"], batch["frame"]) and torch.equal(view["r"], batch["r"])
    batch["r"][n - 1] = float("inf")
    with pytest.raises(SpecError, match="'r'.*NaN/inf"):
        spec.pack(batch, out, check=True)


def test_native_copy_spans_copies_in_order_and_refuses_bad_spans():
    src = torch.arange(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    native.copy_spans((d + 4, s, 3, d, s + 10, 2, d + 8, s, 0))  # a 0-byte span copies nothing
    assert dst.tolist() == [10, 11, 0, 0, 0, 1, 2] + [0] * 9
    with pytest.raises(ValueError, match=r"expected \(dst, src, n\) triples, got 2 values"):
        native.copy_spans((d, s))
    many = torch.zeros(1000, dtype=torch.uint8)  # any number of spans (one per peer: any world)
    m = many.data_ptr()
    native.copy_spans(tuple(x for i in range(500) for x in (m + 2 * i, s + i % 16, 1)))
    assert many[0:1000:2].tolist() == [i % 16 for i in range(500)]
    with pytest.raises(ValueError, match="span 1 has -1 bytes, expected >= 0"):
        native.copy_spans((d, s, 1, d, s, -1))
    assert dst[0] == 10  # refused before any copy


@pytest.mark.parametrize("n", [0, 1, 7, 17_282, 40_000])  # 40k: the GIL-released pass
def test_native_mean2_is_bitwise_torch_add_then_half_and_reads_unaligned(n):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=gen) * 1e3
    b = torch.randn(n, generator=gen) * torch.logspace(-40, 38, max(n, 1))[:n]  # subnormals too
    if n > 3:
        a[:3] = torch.tensor([float("inf"), -0.0, 3.4e38])
        b[:3] = torch.tensor([1.0, 0.0, 3.4e38])  # overflow to inf, signed zeros
    raw = torch.zeros(4 * n + 3, dtype=torch.uint8)  # b's bytes at an odd address
    raw[3:].copy_(b.view(torch.uint8))
    want = a.clone().add_(b).mul_(0.5)
    for first, second in ((a.clone(), raw), (b.clone(), None)):  # each learner's side
        src = raw.data_ptr() + 3 if second is not None else a.data_ptr()
        native.mean2_f32(first.data_ptr(), src, n)
        assert first.view(torch.int32).tolist() == want.view(torch.int32).tolist()
    with pytest.raises(ValueError, match="expected n >= 0 values, got -1"):
        native.mean2_f32(a.data_ptr(), b.data_ptr(), -1)


def test_native_unpack_rows_copies_each_field_out_and_refuses_bad_layouts():
    rows = torch.arange(24, dtype=torch.uint8).view(3, 8)  # 3 rows of 8 bytes, 6 of them used
    a, b = torch.zeros(3, 2, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8)
    dsts = (a.data_ptr(), b.data_ptr())
    native.unpack_rows(rows.data_ptr(), 6, 8, 3, dsts, (2, 1), (1, 5), (0, 0))
    assert a.tolist() == [[1, 2], [9, 10], [17, 18]] and b.view(-1).tolist() == [5, 13, 21]
    with pytest.raises(ValueError, match="field 0 .start 5, size 2. does not fit in a record of 6"):
        native.unpack_rows(rows.data_ptr(), 6, 8, 3, (a.data_ptr(),), (2,), (5,), (0,))
    with pytest.raises(ValueError, match="expected stride >= row_bytes, got stride 4, row_bytes 6"):
        native.unpack_rows(rows.data_ptr(), 6, 4, 3, (a.data_ptr(),), (2,), (0,), (0,))


def _threaded_batch(n: int) -> tuple[ExperienceSpec, dict[str, torch.Tensor]]:
    spec = ExperienceSpec({"obs": ((1000,), torch.float32), "a": ((), torch.int64)})
    g = torch.Generator().manual_seed(0)
    return spec, {"obs": torch.randn(n, 1000, generator=g), "a": torch.arange(n)}


@pytest.mark.parametrize("threads", [2, 3, 16, 64])
def test_native_copies_split_over_threads_match_one_thread(threads):
    """pack_rows, gather_rows and any_nonfinite split large copies over worker threads (the
    caller passes torch.get_num_threads()); the bytes and the verdicts are those of one thread,
    whatever the number of parts (64 is capped at 16)."""
    n = 8401  # 34 MB of records: 2 MiB parts allow 16; rows not divisible by the parts
    spec, batch = _threaded_batch(n)
    one = torch.empty(n, spec.record_bytes, dtype=torch.uint8)
    many = torch.empty_like(one)
    srcs = tuple(batch[k].data_ptr() for k in ("obs", "a"))
    args = (spec.record_bytes, n, srcs, spec._sizes, spec._starts, spec._kinds)
    assert native.pack_rows(one.data_ptr(), *args, 1) == -1
    assert native.pack_rows(many.data_ptr(), *args, threads) == -1
    assert torch.equal(one, many)
    # the copy was split: part w ran on worker w (workers only grow, up to 15)
    assert native.pool_workers() >= min(threads, 16) - 1
    batch["obs"][n - 1, 999] = float("nan")  # in the last part only
    assert native.pack_rows(many.data_ptr(), *args, threads) == 0
    flat = batch["obs"].view(-1)  # 34 MB of floats: split as a scan too (4 MiB parts)
    assert native.any_nonfinite(flat.data_ptr(), flat.numel(), 4, threads)
    batch["obs"][n - 1, 999] = 0.0
    assert not native.any_nonfinite(flat.data_ptr(), flat.numel(), 4, threads)

    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    got1, got = torch.empty_like(one), torch.empty_like(one)
    native.gather_rows(got1.data_ptr(), one.data_ptr(), spec.record_bytes, n, idx.data_ptr(), n)
    native.gather_rows(
        got.data_ptr(), one.data_ptr(), spec.record_bytes, n, idx.data_ptr(), n, -1, threads
    )
    assert torch.equal(got, got1) and torch.equal(got, one[idx])
    gens = idx + 5 * n  # a ring's generations: slot = gen - base, wrapped once past the end
    base = 5 * n - n // 2
    native.gather_rows(
        got.data_ptr(), one.data_ptr(), spec.record_bytes, n, gens.data_ptr(), n, base, threads
    )
    assert torch.equal(got, one[(idx + n // 2) % n])
    idx[n - 1] = n  # out of range in the last part: refused before any row is copied
    got.zero_()
    with pytest.raises(IndexError, match=f"index {n} at position {n - 1} is outside the {n} rows"):
        native.gather_rows(
            got.data_ptr(), one.data_ptr(), spec.record_bytes, n, idx.data_ptr(), n, -1, threads
        )
    assert not got.any()


def _pack_threaded(n: int, threads: int) -> torch.Tensor:
    spec, batch = _threaded_batch(n)
    out = torch.empty(n, spec.record_bytes, dtype=torch.uint8)
    srcs = tuple(batch[k].data_ptr() for k in ("obs", "a"))
    args = (spec.record_bytes, n, srcs, spec._sizes, spec._starts, spec._kinds, threads)
    assert native.pack_rows(out.data_ptr(), *args) == -1
    return out


def _pack_in_child(q) -> None:
    none = native.pool_workers() == 0  # the parent's workers do not exist here
    same = bool((_pack_threaded(3001, 4).numpy() == _pack_threaded(3001, 1).numpy()).all())
    q.put((none, same, native.pool_workers() >= 1))


def test_native_worker_threads_restart_in_a_forked_child():
    """A child forked after the pool's workers started has none of them: its first large copy
    starts its own (rather than waiting forever for threads that do not exist there)."""
    import multiprocessing as mp

    _pack_threaded(3001, 4)  # workers start in this process
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_pack_in_child, args=(q,))
    p.start()
    p.join(timeout=60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive and p.exitcode == 0, f"child: alive={alive}, exit code {p.exitcode}"
    assert q.get(timeout=5) == (True, True, True)


def test_native_split_copies_from_several_threads_at_once():
    """Python threads packing at once (the GIL released): one job runs on the workers at a
    time, a caller that finds one running copies alone, and every result is right."""
    import threading

    want = _pack_threaded(3001, 1).numpy()
    results, errors = [], []

    def run() -> None:
        try:
            for _ in range(20):
                results.append(bool((_pack_threaded(3001, 4).numpy() == want).all()))
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == [True] * 60
