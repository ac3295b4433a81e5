"""The seed papers' tools (calibrate, mask_heads, latency); nothing imports them but ``kvbench.cli``."""
