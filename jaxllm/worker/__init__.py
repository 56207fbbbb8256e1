"""The device side: the model runner and its compiled programs, the paged KV cache, sharding over the mesh and
weight quantization. Pure functions over pytrees and the arrays they run on; no scheduling here."""
