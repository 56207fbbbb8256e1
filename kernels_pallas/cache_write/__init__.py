"""The KV write into the paged cache: Pallas GPU and the ``jnp`` reference."""
