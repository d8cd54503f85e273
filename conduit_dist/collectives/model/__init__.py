"""The bandwidth model: predict each strategy's time for a round's byte matrix, and choose.

- ``costs.py``: the model itself: each strategy's features on a byte matrix (:func:`features`),
  the coefficients per strategy (:class:`BandwidthModel`: predict, choose, describe, declared
  numbers) and the least-squares :func:`fit`;
- ``calibration.py``: how a job gets its numbers: the probe (:func:`calibrate`), rank 0's model
  on every rank (:func:`agree`) and :func:`build` (declared, cached or calibrated);
- ``cache.py``: the calibration cache file per backend, world size and host layout.

The names are re-exported here: ``from conduit_dist.collectives.model import BandwidthModel,
build``.
"""

from conduit_dist.collectives.model.cache import CACHE_VERSION as CACHE_VERSION
from conduit_dist.collectives.model.cache import cache_path as cache_path
from conduit_dist.collectives.model.cache import load_cache as load_cache
from conduit_dist.collectives.model.cache import save_cache as save_cache
from conduit_dist.collectives.model.calibration import PROBE_REPEATS as PROBE_REPEATS
from conduit_dist.collectives.model.calibration import PROBE_SIZES as PROBE_SIZES
from conduit_dist.collectives.model.calibration import agree as agree
from conduit_dist.collectives.model.calibration import build as build
from conduit_dist.collectives.model.calibration import calibrate as calibrate
from conduit_dist.collectives.model.calibration import probe_matrices as probe_matrices
from conduit_dist.collectives.model.calibration import time_strategies as time_strategies
from conduit_dist.collectives.model.costs import FEATURES as FEATURES
from conduit_dist.collectives.model.costs import SOURCES as SOURCES
from conduit_dist.collectives.model.costs import TIE_MARGIN as TIE_MARGIN
from conduit_dist.collectives.model.costs import BandwidthModel as BandwidthModel
from conduit_dist.collectives.model.costs import features as features
from conduit_dist.collectives.model.costs import fit as fit
