"""The engine core: token ids in, token ids out; the scheduler and the model runner in one loop
(``engine_core``), built by ``build``, run in this process or its own (``client`` / ``process``)."""
