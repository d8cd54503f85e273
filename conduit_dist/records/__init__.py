"""Records: the experience spec (``spec.py``: fields, validation), its record layout and packing
(``layout.py``), the C extension's loader (``native.py``) and the reusable record buffers
(``buffers.py``: staging, delivery outputs)."""
