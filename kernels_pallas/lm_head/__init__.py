"""The lm_head (the logits): C++ for the CPU, XLA's dot, and the reference."""
