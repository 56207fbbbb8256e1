"""Ragged and decode paged attention: Pallas GPU, tiled ``jnp`` for XLA, C++ for the CPU, and the reference."""
