"""Builds the one native helper (row packing); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "conduit_dist._native._pack",
            ["conduit_dist/_native/pack.c"],
            extra_compile_args=["-O2"],
        )
    ]
)
