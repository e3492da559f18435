"""The optimized scheduler: same interface and decisions as spec/, much faster."""
