"""Torch runner: executes StepPlans with a real model on a paged KV cache."""
