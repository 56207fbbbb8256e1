"""Sampling: the jitted sampler (``sampler``) and its host side, per-sequence slots and step arrays (``slots``)."""
