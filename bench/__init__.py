"""Benchmarks that print numbers (timing and accuracy goals live here, never in tests)."""
