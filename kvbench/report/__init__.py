"""Reports: job folders as one tidy frame, its tables and figures; imports job, never engine/tools (ARCHITECTURE.md)."""
