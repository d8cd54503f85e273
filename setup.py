"""Builds the native helpers (row packing, NaN/inf counting); the rest is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "conduit_dist._native._pack",
            ["conduit_dist/_native/pack.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
