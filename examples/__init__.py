"""Example schedulers that do not follow vLLM's policy, each wrapped in the
Scheduler protocol by a small adapter, each with a deliberately broken
variant (docs/adapters.md walks through them)."""
