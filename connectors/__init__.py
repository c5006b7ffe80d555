"""Part of kvtier; see docs/architecture.md."""
