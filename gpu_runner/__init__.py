"""Torch runner: executes StepPlans with a real model on a paged KV cache.

``model`` (the paged Llama, exact and fast modes), ``loaders`` (glassllm, random,
Hugging Face directories, GGUF), ``executor`` (StepPlan -> StepResult),
``equivalence`` (the token-equivalence matrix), ``cli`` (``schedspec equivalence``).
Importing this package alone imports nothing heavy; its modules import torch.
"""
