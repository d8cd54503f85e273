"""Checkpoints of a data plane that do not stop the world, restorable onto another world size.

``save.py`` agrees on a round boundary and snapshots; ``snapshot.py`` keeps the snapshot
consistent while rounds write (copy-on-write); ``writer.py`` writes it on a thread; ``files.py``
is the on-disk layout and manifest; ``restore.py`` deals the items out again. See
docs/reliability.md.
"""

from conduit_dist.checkpoint.files import latest
from conduit_dist.checkpoint.writer import Checkpoint

__all__ = ["Checkpoint", "latest"]
