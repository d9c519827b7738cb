"""Hand-written kernels for paths where PyTorch has no fused operator (see each module)."""
