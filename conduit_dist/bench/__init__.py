"""Benchmarks: ``python -m conduit_dist.bench NAME`` (under torchrun where they need ranks).

Each benchmark measures conduit_dist and its baseline side by side in one run and prints one JSON
line last, with a ``summary`` object of ratios.
"""

BENCHES = (
    "store", "ingest", "latency", "strategies", "placement", "scaling", "rounds", "per",
    "sequences", "ppo", "checkpoint", "tokens", "remote", "sim", "attach",
    "weights", "rllib",
)  # fmt: skip
