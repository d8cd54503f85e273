"""Faces for users' loops over a DataPlane: the loader (``ExperienceLoader`` /
``ExperienceWriter``) and the TorchRL-compatible buffer (``integrations.torchrl``, optional)."""
