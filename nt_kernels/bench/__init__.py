"""``nt-kernels bench``: the fused op against the loop reference and the paper's strategies.

* :mod:`nt_kernels.bench.cli`: the command (graphs, runs, JSON documents, table);
* :mod:`nt_kernels.bench.context`: what a backend is and what it runs on (shared by the next two);
* :mod:`nt_kernels.bench.backends`: the compared backends and their applicability;
* :mod:`nt_kernels.bench.peers`: the peers, what a user would write instead of our op;
* :mod:`nt_kernels.bench.measure`: the measuring worker (memory, time, error) and the run's provenance;
* :mod:`nt_kernels.bench.layer`: ``--layer``, NT training steps fused vs unfused, with its graphs
  (:mod:`nt_kernels.bench.layer_graphs`) and its table (:mod:`nt_kernels.bench.layer_report`);
* :mod:`nt_kernels.bench.plot`: the efficiency figure and each result file's block (on its run page);
* :mod:`nt_kernels.bench.headline`: the op and layer headline tables of docs/results.md (``nt-kernels
  results``, :mod:`nt_kernels.apps.results_page`).
"""
