"""Triton kernels of the CUDA target (issue 17): one file per kernel, each a `@triton.jit` kernel and a launcher
that takes torch tensors. Importing this package does not import triton; each kernel module does. See README.md."""
