"""The caller's process: strings in, ``RequestOutput``s out (``LLMEngine``, ``AsyncLLM`` and their shared parts);
nothing here imports JAX."""
