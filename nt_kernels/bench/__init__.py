"""``nt-kernels bench``: the fused op against the loop reference and the paper's strategies.

* :mod:`nt_kernels.bench.cli`: the command (graphs, runs, JSON documents, table);
* :mod:`nt_kernels.bench.backends`: the compared backends and their applicability;
* :mod:`nt_kernels.bench.measure`: the measuring worker (memory, time, error);
* :mod:`nt_kernels.bench.plot`: the efficiency figure and the tables of docs/results.md.
"""
