"""The experience ledger: per attached producer, what it put, what a shard acknowledged, what
was delivered and what was dropped, and why (``Ingress.ledger``, ``stats()["attached"]``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Account:
    """One attached producer's ledger on its ingress rank.

    ``put``: puts received (resent duplicates not counted); ``acked``: puts a shard holds
    (acknowledged), with their ``items`` (sequences or rows) and ``groups`` (token planes);
    ``duplicates``: puts received again after a reattach and acknowledged without storing them
    twice; ``refused``: puts the plane refused whole (the error went back); ``delivered``:
    deliveries of its groups to learners (token planes; a replayed group counts each time);
    ``dropped``: its groups dropped incomplete, by id, and ``dropped_why``; ``lost``: puts a
    shard had acknowledged after the checkpoint the job was restored from (they died with the
    job: the producer had let them go), and ``lost_why``; ``unknown``: puts an earlier job
    acknowledged whose ledger this job did not restore (no checkpoint of it, e.g. a
    ``DataPlane``'s): delivered or lost, it cannot tell; ``state``: ``live``,
    ``disconnected`` (waiting for a reattach), ``closed``, ``dead`` or ``restored`` (from a
    checkpoint, not reattached yet).
    """

    producer: str
    state: str = "live"
    attaches: int = 0
    put: int = 0
    acked: int = 0
    items: int = 0
    groups: int = 0
    duplicates: int = 0
    refused: int = 0
    delivered: int = 0
    dropped: list[int] = field(default_factory=list)
    dropped_why: str = ""
    lost: int = 0
    lost_why: str = ""
    unknown: int = 0
    last_seq: int = 0  # the newest put acknowledged (a reattach resends only those after it)

    def as_dict(self) -> dict[str, object]:
        """A plain dict (for ``stats()``, metrics and W&B)."""
        return asdict(self)


def totals(accounts: list[Account]) -> dict[str, int]:
    """Sums over producers (flat numbers for metrics); accounts restored from a checkpoint whose
    producer has not reattached here are left out (every rank restores them all)."""
    accounts = [a for a in accounts if a.state != "restored"]
    keys = ("put", "acked", "items", "groups", "duplicates", "refused", "delivered")
    out = {f"attached_{k}": sum(getattr(a, k) for a in accounts) for k in keys}
    out["attached_dropped_groups"] = sum(len(a.dropped) for a in accounts)
    out["attached_lost"] = sum(a.lost for a in accounts)
    out["attached_unknown"] = sum(a.unknown for a in accounts)
    out["attached_live"] = sum(a.state == "live" for a in accounts)
    out["attached_dead"] = sum(a.state == "dead" for a in accounts)
    return out


def merge(states: list[dict[str, dict]]) -> dict[str, Account]:
    """One ledger from every old rank's (a checkpoint's ``ledger`` entries): per producer the
    counters summed, ``last_seq`` the newest, ``dropped`` joined; state ``restored``."""
    out: dict[str, Account] = {}
    for state in states:
        for pid, d in state.items():
            a = out.setdefault(pid, Account(pid, state="restored"))
            for k in ("attaches", "put", "acked", "items", "groups", "duplicates", "refused",
                      "delivered", "lost", "unknown"):  # fmt: skip
                setattr(a, k, getattr(a, k) + int(d.get(k, 0)))
            a.dropped += [int(g) for g in d.get("dropped", [])]
            a.dropped_why = a.dropped_why or str(d.get("dropped_why", ""))
            a.lost_why = a.lost_why or str(d.get("lost_why", ""))
            a.last_seq = max(a.last_seq, int(d.get("last_seq", 0)))
    return out
