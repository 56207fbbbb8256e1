"""The device block pool, the KV cache manager, and the tiers (``scheduler.kv.tier.KVTier``) of KV off the device."""
