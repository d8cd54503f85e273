"""Native helpers, built by ``pip install`` (setup.py). See ``pack.c``."""
