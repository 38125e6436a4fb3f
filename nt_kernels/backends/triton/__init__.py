"""Triton backend: exact softmax attention over CSR segments (flash-style, varlen) on CUDA.

* :mod:`~nt_kernels.backends.triton.plan`: the flat work lists ("plans") the kernels walk;
* :mod:`~nt_kernels.backends.triton.softmax_fwd` / :mod:`~nt_kernels.backends.triton.softmax_bwd`:
  the forward and backward kernels and their launchers;
* :mod:`~nt_kernels.backends.triton.register`: the implementations of
  ``nt_kernels::softmax_fwd_into`` / ``softmax_bwd_into`` and their CUDA registration.

Importing this package imports nothing (not even triton).  On a machine
without a GPU set ``TRITON_INTERPRET=1`` before triton is first imported to run
the kernels on CPU tensors.
"""
