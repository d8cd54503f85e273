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
