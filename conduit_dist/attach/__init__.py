"""Producers outside the job: attach to a running plane through an ingress rank, put, pull
weights, leave, or die, with every put acknowledged once a shard holds it (docs/attach.md)."""

from conduit_dist.attach.client import AttachedProducer, attach
from conduit_dist.attach.ingress import Ingress

__all__ = ["AttachedProducer", "Ingress", "attach"]
