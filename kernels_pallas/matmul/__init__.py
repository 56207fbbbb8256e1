"""The projection matmul over stacked layer weights: C++ for the CPU, XLA's dot, and the reference."""
