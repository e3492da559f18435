"""schedspec.testing."""
