"""schedspec.bench."""
