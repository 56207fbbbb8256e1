"""The caller's process: strings in, ``RequestOutput``s out (``LLMEngine``, ``AsyncLLM`` and the parts they share).

Tokenizing, validating, detokenizing, stop strings, ``n > 1`` grouping and metrics; nothing here imports JAX, so
the server's front end stays light and its engine cores hold the device.
"""
