"""Tensor-parallel decode (head sharding, per-rank grid sizing) lives here; see docs/design.md."""
