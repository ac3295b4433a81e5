"""The engine: models, kvbench's attention, the caches, prefill/decode; no other kvbench package (ARCHITECTURE.md)."""
