"""schedspec.adapters."""
