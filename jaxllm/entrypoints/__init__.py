"""Entry points: ``LLM`` (offline, ``llm.py``), the ``jaxllm`` command (``cli.py``: ``generate``, ``serve``) and
the OpenAI-compatible HTTP server (``openai/``)."""
