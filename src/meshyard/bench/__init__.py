"""Benchmarks as product features: collectives, scaling over workers, gradient compression."""
