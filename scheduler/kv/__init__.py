"""The device block pool, the KV cache manager, and the tiers of KV held off the device pool.

Each tier implements ``KVTier`` (``scheduler.kv.tier``): the scheduler asks it for hits at admission and for room
at a shortage, and collects the block copies it queues into the step's one ordered list.
"""
