"""Benchmarks that print JSON: ``python -m lightning_hydra.bench.schedule`` (planner)."""

__all__: list[str] = []
