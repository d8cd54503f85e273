"""TransferQueue's side of ``bench tokens --peer transferqueue``, used as its docs use it for GRPO.

TransferQueue 0.1.11 (``pip install -e ".[peers]"``): a ``TransferQueueController`` Ray actor
running its ``SeqlenBalancedSampler`` (whole GRPO groups of ``n_samples_per_prompt`` consecutive
samples, Karmarkar-Karp over the data-parallel ranks by each sample's ``total_lengths``), two
``SimpleStorageUnit`` actors (its default storage, ZMQ servers holding the samples), and one
client per bench rank:

- a producer builds a ``TensorDict`` of its groups (ragged fields as jagged nested tensors, the
  form its docs put variable-length responses in; views of the packed columns, no copy), asks the
  controller for insert metadata, attaches every sample's ``total_lengths`` (the custom meta the
  sampler balances by) and ``put`` s it: the data moves to the storage units;
- a learner reads through its ``StreamingDataset`` / ``StreamingDataLoader`` (``dp_rank`` = its
  learner index, one partition per global batch and ``loader.step(partition)`` between them, as
  its Relax recipe does; ``num_workers=0`` as there too): ``get_meta`` from the controller's
  sampler, ``get_data`` from the storage units, then its micro-batches of ``micro_batch_size``
  samples, each field a jagged nested tensor (packed values and offsets, i.e. ``cu_seqlens``).

Ray is started by rank 0 in this process (``ray.init`` with 3 logical CPUs: the controller and
each storage unit reserve one; no dashboard); the other ranks get the controller's and storage
units' ZMQ addresses from rank 0 (a broadcast) and build their clients from them, as
``StreamingDataset`` itself does in its worker processes.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from conduit_dist.bench.token_baselines import FIELDS, Data

TASK = "update_actor"  # the loader's consumer task
TASK_CLIENT = "update_actor_client"  # the client variant's
DATA_FIELDS = [*(n for n, _ in FIELDS), "reward", "group"]


def available() -> str | None:
    """``None`` when ``transfer_queue`` imports, else why not (for a skip or an error)."""
    _quiet_threads()
    try:
        import transfer_queue  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        return f"transferqueue is not installed ({e}); pip install -e '.[peers]'"
    return None


def _quiet_threads() -> None:
    # TransferQueue caps torch's threads at TQ_NUM_THREADS (default 8) clamped to the physical
    # cores, warning on every put and get when it clamps; the clamped value is set up front so
    # the behaviour is the same and the log is quiet (Ray's actors inherit the variable).
    import psutil

    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))


class TQ:
    """One rank's TransferQueue parts: the system itself on rank 0, a client everywhere.

    Args:
        learners: the learner ranks (``dp_rank`` = position in this list).
        group_size: samples per GRPO group (the sampler's ``n_samples_per_prompt``).
        micro_batch_size: samples per micro-batch of a learner's loader.
    """

    def __init__(self, learners: list[int], group_size: int, micro_batch_size: int) -> None:
        _quiet_threads()
        import ray
        import transfer_queue as tq
        from omegaconf import OmegaConf

        self.me, self.learners = dist.get_rank(), learners
        self.owner = self.me == 0
        conf = [None]
        if self.owner:
            ray.init(num_cpus=3, include_dashboard=False, namespace=f"bench_{uuid.uuid4().hex[:8]}")
            sampler = tq.SeqlenBalancedSampler(
                n_samples_per_prompt=group_size, dp_size=len(learners)
            )
            conf[0] = tq.init(
                OmegaConf.create(
                    {
                        "controller": {"sampler": sampler, "polling_mode": True},
                        "backend": {"SimpleStorage": {"num_data_storage_units": 2}},
                    },
                    flags={"allow_objects": True},
                )
            )
        dist.broadcast_object_list(conf, src=0)
        self.conf = conf[0]
        self.client = tq.TransferQueueClient(f"bench_rank{self.me}", self.conf.controller.zmq_info)
        backend = self.conf.backend.storage_backend
        self.client.initialize_storage_manager(
            manager_type=backend, config=self.conf.backend[backend]
        )
        self.loader = None
        if self.me in learners:
            self.dataset = tq.StreamingDataset(
                config=self.conf, batch_size=1, micro_batch_size=micro_batch_size,
                data_fields=DATA_FIELDS, partition_id="", task_name=TASK,
                dp_rank=learners.index(self.me),
            )  # fmt: skip
            self.loader = tq.StreamingDataLoader(self.dataset, num_workers=0)

    def put(self, d: Data, partition: str) -> None:
        """A producer's groups into the storage units, with each sample's ``total_lengths``."""
        n = len(d.lengths)
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(d.lengths, 0)
        from tensordict import TensorDict

        ragged = {
            k: torch.nested.nested_tensor_from_jagged(v, offsets) for k, v in d.fields.items()
        }
        td = TensorDict({**ragged, "reward": d.reward, "group": d.group}, batch_size=[n])
        meta = self.client.get_meta(
            data_fields=list(td.keys()), batch_size=n, partition_id=partition, mode="insert"
        )
        meta.update_custom_meta([{"total_lengths": int(x)} for x in d.lengths.tolist()])
        self.client.put(td, metadata=meta)

    def prepare(self, partition: str, samples: int) -> None:
        """Point the learner's loader at a global batch's partition (untimed)."""
        self.dataset.batch_size = samples  # this learner's share: the sampler's per-DP size
        self.loader.step(partition)

    def take_client(self, partition: str, samples: int) -> list[dict[str, torch.Tensor]]:
        """The neutral variant: a learner's share through the client itself (``get_meta`` from
        the same sampler under another task name, ``get_data``), cut into micro-batches of
        ``micro_batch_size`` samples as views of the returned packed values (no loader: its
        chunking deep-copies the batch's metadata once per micro-batch)."""
        meta = self.client.get_meta(
            data_fields=DATA_FIELDS, batch_size=samples, partition_id=partition,
            task_name=TASK_CLIENT, sampling_config={
                "dp_rank": self.dataset.dp_rank, "batch_index": 0, "partition_id": partition
            },
        )  # fmt: skip
        td = self.client.get_data(meta)
        offsets = td["tokens"].offsets()
        values = {k: td[k].values() for k, _ in FIELDS}
        out, step = [], self.dataset.micro_batch_size
        for s in range(0, samples, step):
            e = min(s + step, samples)
            a, b = int(offsets[s]), int(offsets[e])
            mb = {k: v[a:b] for k, v in values.items()}
            mb |= {"reward": td["reward"][s:e], "group": td["group"][s:e]}
            mb["cu_seqlens"] = offsets[s : e + 1] - a
            out.append(mb)
        return out

    def take(self, micro_batches: int) -> list[dict[str, torch.Tensor]]:
        """A learner's micro-batches of the prepared partition, packed: each ragged field's
        values, the fixed fields and ``cu_seqlens`` (the nested tensors' offsets)."""
        out, it = [], iter(self.loader)
        for _ in range(micro_batches):  # no further next(): it would poll for the next batch
            td, _meta = next(it)
            offsets = td["tokens"].offsets()
            mb = {k: td[k].values() for k, _ in FIELDS}
            # packed: the values are this micro-batch's tokens alone (a slice of a bigger
            # nested buffer would start past 0 or hold more than its last offset)
            if int(offsets[0]) != 0 or int(offsets[-1]) != mb["tokens"].shape[0]:
                raise RuntimeError(
                    f"bench tokens --peer: a TransferQueue micro-batch is not packed: offsets "
                    f"{int(offsets[0])}..{int(offsets[-1])}, values {mb['tokens'].shape[0]}"
                )
            mb |= {"reward": td["reward"], "group": td["group"], "cu_seqlens": offsets}
            out.append(mb)
        return out

    def clear(self, partition: str) -> None:
        """Drop a consumed partition from the controller and the storage units (rank 0)."""
        self.client.clear_partition(partition)

    def close(self, failed: bool = False) -> None:
        """Close this rank's client; rank 0 then stops the system and Ray (after a barrier, or
        at once where ``failed``: a peer may be stuck in another collective, and a barrier
        would only wait for the timeout)."""
        self.client.close()
        if not failed:
            dist.barrier()
        if self.owner:
            import ray
            import transfer_queue as tq

            tq.close()
            ray.shutdown()
