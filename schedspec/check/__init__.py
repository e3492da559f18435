"""schedspec.check."""
