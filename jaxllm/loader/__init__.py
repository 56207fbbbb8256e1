"""Weight loaders: each turns a checkpoint into (HF-style config dict, HF-named numpy arrays)."""
