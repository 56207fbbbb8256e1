"""Device kernels for jaxllm, with no knowledge of models or the scheduler.

One folder per op, each holding its backends side by side and its plain ``jnp`` reference:

* ``attention/``: ragged and decode paged attention: Pallas GPU (``pallas_ragged.py``, ``pallas_decode.py``),
  tiled ``jnp`` for XLA (``xla.py``), C++ for the CPU (``cpu.py``, ``paged_attention_cpu.cc``), ``reference.py``.
* ``cache_write/``: the KV write: Pallas GPU (``pallas.py``) and ``reference.py`` (the ``jnp`` scatter).
* ``matmul/``: the projection matmul over stacked layer weights: C++ (``cpu.py``, ``matmul_cpu.cc``), XLA's dot
  (``xla.py``), ``reference.py``.
* ``lm_head/``: the logits: C++ (``cpu.py``; its source is in ``matmul/matmul_cpu.cc``), XLA's dot (``xla.py``),
  ``reference.py``.

Beside them: ``ops.py``, the ops table that picks a backend per op and platform (the one module models import),
``storage.py`` (how caches and weights are stored: bit patterns, quantized values), ``cpu_build.py`` (builds and
loads the C++ library), ``cpu_features.py`` (the CPU's instruction sets) and the Pallas helpers ``_flash.py``,
``_compat.py``.
"""
