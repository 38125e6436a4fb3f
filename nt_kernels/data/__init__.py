"""Graphs for tests, benchmarks, training and the demo; nothing is ever downloaded.

* :mod:`nt_kernels.data.graphs`: npz loading, the data root, seeded synthetic graphs;
* :mod:`nt_kernels.data.datasets`: the paper's training datasets with their splits,
  and a small synthetic monophily graph.
"""
from nt_kernels.data.datasets import (DATASETS, HETEROPHILOUS, HOMOPHILOUS, SELF_LOOPS, load_dataset,
                                      monophily_graph, random_splits)
from nt_kernels.data.graphs import (DATA_ROOT_ENV, PAPER_GRAPHS, GraphData, SyntheticPreset, default_data_root,
                                    load_npz, powerlaw_graph, synthetic_graph, to_undirected)

__all__ = ["DATASETS", "DATA_ROOT_ENV", "HETEROPHILOUS", "HOMOPHILOUS", "PAPER_GRAPHS", "SELF_LOOPS", "GraphData",
           "SyntheticPreset", "default_data_root", "load_dataset", "load_npz", "monophily_graph", "powerlaw_graph",
           "random_splits", "synthetic_graph", "to_undirected"]
