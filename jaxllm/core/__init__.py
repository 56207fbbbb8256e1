"""The engine core: token ids in, token ids out; the scheduler and the model runner in one loop.

``engine_core`` (the loop object), ``build`` (start-up), ``messages`` (what crosses the process line),
``client`` / ``process`` (the core in this process or in its own), ``router`` (which data-parallel core gets a
request), ``prompt_logprobs``.
"""
