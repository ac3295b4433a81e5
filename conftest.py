"""Makes the repository root importable when tests run with a bare `pytest` (no install)."""
