"""Token experience for LLM RL: ragged sequences, prompt groups, token-balanced delivery.

``TokenSpec`` / ``Ragged`` declare the fields, ``TokenPlane`` stores and delivers them,
``MicroBatch`` is what a learner receives; ``balance`` divides a global batch by tokens.
"""

from conduit_dist.tokens.batch import MicroBatch
from conduit_dist.tokens.plane import TokenPlane
from conduit_dist.tokens.spec import Ragged, TokenSpec

__all__ = ["MicroBatch", "Ragged", "TokenPlane", "TokenSpec"]
