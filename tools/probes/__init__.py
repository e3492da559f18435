"""Measurement probes: schedulers that are wrong on purpose, to bound what a
change could save (docs/impl.md). Never a scheduler to check."""
