"""DataPlane: the public put / fetch / flush / weights API over a sharded experience store.

``core.py`` holds the class; ``producer.py`` (``put``, ``staged``) and ``overlap.py`` (``attach``,
the backward launch, the auto trial) are its mixins.
"""

from conduit_dist.plane.core import DECLARED, DataPlane, RoundStats

__all__ = ["DECLARED", "DataPlane", "RoundStats"]
