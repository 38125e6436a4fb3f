"""Applications on top of the library: the ``train`` and ``demo`` commands.

* :mod:`nt_kernels.apps.train`: full-batch node classification (paper protocol, presets, CLI);
* :mod:`nt_kernels.apps.demo`: the fused op against the paper's strategies, then NT vs an MLP.
"""
