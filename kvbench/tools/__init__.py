"""The seed papers' tools: HeadKV / CompressKV score calibration (``calibrate``), NIAH with heads masked
(``mask_heads``), SelKV's latency benchmark (``latency``). Nothing imports them but ``kvbench.cli``."""
