"""Device kernels for jaxllm, with no knowledge of models or the scheduler.

One folder per op, its backends beside its plain ``jnp`` ``reference.py``: ``attention/`` (Pallas GPU ragged and
decode through Triton, the same two through Mosaic GPU for Hopper, ``xla.py`` tiles, C++ ``cpu.py``),
``cache_write/`` (Pallas GPU, ``jnp`` scatter), ``matmul/`` (C++ over stacked weights, XLA's dot), ``lm_head/``
(C++, XLA's dot). ``ops.py`` is the ops table models import; ``storage.py``, ``cpu_build.py``, ``cpu_features.py``,
``_flash.py``, ``_mosaic.py``, ``_compat.py`` support them.
"""
