"""Data sources and the sharded input pipeline."""
