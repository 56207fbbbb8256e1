"""The device side: the model runner and the three parts it composes (a program table, a KV cache, a weight store),
sharding over the mesh and weight quantization. No scheduling here."""
