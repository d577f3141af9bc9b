"""Benchmarks of specsamp (not part of the library): ``python -m benchmarks.<name>``; ``make bench`` runs them."""
