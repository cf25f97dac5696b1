"""Operators. Each folder holds reference.py (the fp32 oracle), its kernels and its autograd Function."""
