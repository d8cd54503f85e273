"""The GPU path's logic, exercised on the CPU: ``train.py device=cuda`` refused at once without
CUDA, the device resolved once and round gradient averaging refused on a GPU, one host read per
put (NaN check) and per fetch (age check), weights crossing to and from the host in one copy.

A "host read" is what makes a CUDA stream synchronise with the host (``item``, ``tolist``,
``bool``, ``float``, ``int``, ``cpu``); counted with a ``TorchFunctionMode`` on CPU tensors,
where the same code path runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import ROOT, child_env, needs_native, run_ranks
from plane_helpers import fill
from torch import nn
from torch.overrides import TorchFunctionMode

import conduit_dist as cd
from conduit_dist.errors import ConfigError, SpecError, StaleDataError
from conduit_dist.flow.versions import check_ages
from conduit_dist.flow.weights import WeightsState
from conduit_dist.records import layout
from conduit_dist.records.layout import nonfinite
from conduit_dist.records.spec import ExperienceSpec
from conduit_dist.rl.host_weights import HostWeights
from conduit_dist.train import setup
from conduit_dist.train.config import TrainConfig

HOST_READS = {"__bool__", "item", "tolist", "__float__", "__int__", "__index__", "cpu", "numpy"}


class Reads(TorchFunctionMode):
    """Counts the host reads of torch tensors, and the ``copy_`` calls by destination."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.copies: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        if name == "copy_":
            self.copies.append(args[0])
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------- train.py without CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without")
@pytest.mark.parametrize(
    "overrides",
    [("device=cuda",), ("device=cuda:1", "algo=ppo", "mode=disaggregated")],
    ids=["dqn-default-experiment", "ppo-disaggregated"],
)
def test_train_py_on_cuda_fails_at_once_without_cuda(tmp_path, overrides):
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, "logger=none"]
    t0 = time.monotonic()
    res = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    wall = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    device = overrides[0].split("=")[1]
    assert re.search(
        rf"ConfigError: device: got '{device}', but CUDA is not available here \(torch "
        rf"{re.escape(torch.__version__)}, built with CUDA None\); install a CUDA build of torch",
        out,
    ), out[-3000:]
    # before anything was built: no logger (it writes metrics.jsonl and run.json), no env
    # steps, no plane (whose learners log how they average gradients)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "run.json").exists()
    assert "average gradients" not in out and "done:" not in out
    assert wall < 60, f"{wall:.1f} s: the refusal should come at start-up (~4 s here)"


# ----------------------------------------------------------------- device and gradients


def test_device_is_resolved_once_and_round_gradients_ride_the_round_on_a_gpu_too():
    cfg = TrainConfig()
    cfg.plane.placement, cfg.algo.grad_sync = "local", "auto"
    assert setup.device(cfg) == torch.device("cpu")
    gpu = torch.device("cuda", 0)  # a device object needs no GPU
    assert setup.grad_sync(cfg, [0, 1], torch.device("cpu")) == "round"
    assert setup.grad_sync(cfg, [0, 1], gpu) == "round"  # all-reduced on the plane's NCCL group
    cfg.plane.placement = "round_robin"  # DDP: gloo's all_to_all trick on the CPU only
    assert setup.grad_sync(cfg, [0, 1], torch.device("cpu")) == "all_to_all"
    assert setup.grad_sync(cfg, [0, 1], gpu) == "allreduce"
    cfg.algo.grad_sync, cfg.plane.schedule = "round", "overlap"
    with pytest.raises(ConfigError, match=r"algo.grad_sync: 'round' .* schedule='overlap'"):
        setup.grad_sync(cfg, [0, 1], gpu)
    cfg.device = "cuda"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available here"):
            setup.device(cfg)


# ----------------------------------------------------------------- host reads


def _batch(n: int = 16) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.randn(n, 4),
        "reward": torch.randn(n),
        "value": torch.randn(n, dtype=torch.float64),
        "half": torch.randn(n, 2).half(),
        "action": torch.randint(0, 3, (n,)),
    }


def test_nan_check_reads_the_host_once_per_put_for_every_float_field(monkeypatch):
    # the path every field off the C extension's CPU scan takes (CUDA tensors); without the
    # extension, CPU tensors take it too
    monkeypatch.setattr(layout, "_native", None)
    batch = _batch()
    spec = ExperienceSpec.from_batch(batch)
    with Reads() as r:
        spec.check_finite(batch)
    assert r.reads == ["tolist"], r.reads  # 4 float fields, one read
    batch["value"][3] = float("nan")
    with pytest.raises(SpecError, match="field 'value': expected finite values, got 1 NaN/inf"):
        spec.check_finite(batch)
    rows = spec.empty_records(16)
    with Reads() as r, pytest.raises(SpecError, match="field 'value'"):
        spec.pack(batch, rows, check=True)
    assert r.reads.count("tolist") == 1


def test_nonfinite_names_each_bad_tensor_and_tells_overflow_from_nan():
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    nan, inf = torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")], dtype=torch.float64)
    acc = [torch.float32, torch.float32, torch.float64, torch.float32]
    with Reads() as r:
        assert nonfinite([big, nan, inf, torch.zeros(2)], acc) == [1, 2]
    # one read for the four sums, one exact re-check each for the three non-finite sums
    assert r.reads.count("tolist") == 1 and r.reads.count("__bool__") == 3
    with Reads() as r:
        assert nonfinite([torch.ones(3), torch.ones(2, dtype=torch.float64)], acc[1:3]) == []
    assert r.reads == ["tolist"]


def test_nan_check_without_the_fallback_reads_nothing_through_torch():
    batch = _batch()
    spec = ExperienceSpec.from_batch(batch)
    needs_native("any_nonfinite", "rows_nonfinite")
    with Reads() as r:
        spec.check_finite(batch)
    assert r.reads == []


def test_age_check_reads_the_host_once_per_fetch():
    version = torch.tensor([5, 6, 7, 7])
    with Reads() as r:
        check_ages(version, newest=7, max_age=2, rank=0, round=3)
    assert len(r.reads) == 1, r.reads
    with Reads() as r:
        check_ages(version, newest=2, max_age=3, rank=0, round=3)  # vacuous bound
    assert r.reads == []
    with pytest.raises(StaleDataError, match=r"rank 1 in round 4: 1 of 4 items .* 5\.\.5"):
        check_ages(version, newest=8, max_age=2, rank=1, round=4)


# ----------------------------------------------------------------- weights


class Net(nn.Module):
    """float parameters, a BatchNorm's float and int64 buffers: mixed dtypes and sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5)
        self.bn = nn.BatchNorm1d(5)


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=k)


def test_host_weights_cross_in_one_copy_each_way():
    src = HostWeights(fill(Net(), 0), torch.device("cpu"), mirror=True)
    dst = HostWeights(fill(Net(), 1), torch.device("cpu"), mirror=True)
    ws = WeightsState()
    for seed in (2, 3):
        fill(src.module, seed)
        with Reads() as r:
            host = src.to_host()
        into_host = [d for d in r.copies if d.data_ptr() == src._flat.data_ptr()]
        assert len(into_host) == 1 and host is not src.module  # the whole state, once
        _same(src.module, host)
        ws.publish(host)
        assert ws.pull(dst.host) == ws.version
        with Reads() as r:
            dst.to_device()
        assert sum(d.data_ptr() == dst._dev.data_ptr() for d in r.copies) == 1
        _same(src.module, dst.module)


def test_host_weights_on_the_cpu_hand_the_network_itself():
    net = Net()
    w = HostWeights(net, torch.device("cpu"))
    assert not w.mirrored and w.to_host() is net and w.host is net


def _publish_pull(rank: int, world: int) -> list[int]:
    spec = ExperienceSpec.from_batch({"x": torch.zeros(1, 2)})
    plane = cd.DataPlane(
        spec,
        32,
        learner_ranks=[0],
        schedule="sync",
        transport=cd.TransportConfig(timeout_s=30),
    )
    w = HostWeights(fill(Net(), 10 + rank), torch.device("cpu"), mirror=True)
    loads, versions = [], []
    for step in range(3):
        if rank == 0 and step < 2:  # versions 1, 2, then nothing new
            fill(w.module, 20 + step)
            w.publish(plane)
        plane.flush()
        if rank == 1:
            with Reads() as r:
                versions.append(w.pull(plane))
            loads.append(sum(d.data_ptr() == w._dev.data_ptr() for d in r.copies))
    state = {k: v.tolist() for k, v in w.module.state_dict().items()}  # no tensor in the queue
    plane.close()
    return [versions, loads, state]


def test_published_weights_reach_an_actor_and_load_once_per_version():
    res = run_ranks(_publish_pull, 2, timeout_s=120)
    versions, loads, state = res[1]
    assert versions == [1, 2, 2] and loads == [1, 1, 0]  # the third pull: nothing new
    assert state == res[0][2]  # the learner's last published weights, exactly
