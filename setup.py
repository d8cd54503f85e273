"""Builds the native helpers (row packing, NaN/inf scans, draws, trees, sequence links and
n-step rows, the shared-memory barrier, worker threads for large copies); the rest is in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "conduit_dist._native._pack",
            [
                "conduit_dist/_native/pack.c",
                "conduit_dist/_native/seq.c",
                "conduit_dist/_native/shmbar.c",
                "conduit_dist/_native/pool.c",
            ],
            depends=[
                "conduit_dist/_native/seq.h",
                "conduit_dist/_native/shmbar.h",
                "conduit_dist/_native/pool.h",
            ],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
