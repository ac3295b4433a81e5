"""The seed papers' tools: head and layer score calibration for HeadKV / CompressKV (``calibrate``), NIAH with
heads masked (``mask_heads``) and SelKV's latency benchmark (``latency``). Imports
``kvbench.job`` and ``kvbench.engine``; nothing imports it but ``kvbench.cli``.
"""
