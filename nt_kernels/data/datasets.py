"""Training datasets of the paper, read from local files only, and a synthetic monophily graph.

* The five heterophilous graphs (Platonov et al.) from a flat
  ``<root>/<name>.npz`` or PyG's ``HeterophilousGraphDataset`` layout
  ``<root>/<name_with_underscores>/raw/<name_with_underscores>.npz``, with their
  10 fixed splits.
* Amazon Computers / Photo, Coauthor CS / Physics and WikiCS through PyG's
  dataset classes once their raw files are in place (the error message says
  where); the first four get 10 seeded 60/20/20 random splits (paper §5), WikiCS
  keeps its own splits.

Nothing is ever downloaded: a missing file raises ``FileNotFoundError``
naming the path and what to put there.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nt_kernels.data.graphs import GraphData, default_data_root, load_npz, to_undirected

__all__ = ["DATASETS", "HETEROPHILOUS", "HOMOPHILOUS", "SELF_LOOPS", "load_dataset", "monophily_graph",
           "random_splits"]

HETEROPHILOUS = ("roman-empire", "amazon-ratings", "minesweeper", "tolokers", "questions")
# name -> (PyG class, PyG name, raw file relative to root)
HOMOPHILOUS = {
    "amazon-computers": ("Amazon", "Computers", "Computers/raw/amazon_electronics_computers.npz"),
    "amazon-photo": ("Amazon", "Photo", "Photo/raw/amazon_electronics_photo.npz"),
    "coauthor-cs": ("Coauthor", "CS", "CS/raw/ms_academic_cs.npz"),
    "coauthor-physics": ("Coauthor", "Physics", "Physics/raw/ms_academic_phy.npz"),
    "wikics": ("WikiCS", None, "WikiCS/raw/data.json"),
}
DATASETS = HETEROPHILOUS + tuple(HOMOPHILOUS)
SELF_LOOPS = ("keep", "add", "remove")
NUM_RANDOM_SPLITS = 10


def _heterophilous_path(name: str, root: Path) -> Path:
    stem = name.replace("-", "_")
    candidates = [root / f"{name}.npz", root / f"{stem}.npz", root / stem / "raw" / f"{stem}.npz"]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"load_dataset: no file for {name!r} under {root}; put the HeterophilousGraphDataset file "
        f"{stem}.npz at {candidates[0]} or {candidates[2]} (pass data_root= / --data-root, or set "
        "$NT_KERNELS_DATA); nothing is downloaded")


def random_splits(num_nodes: int, num_splits: int = NUM_RANDOM_SPLITS, *, train: float = 0.6, val: float = 0.2,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random train/val/test masks of shape (num_splits, num_nodes); the rest of the nodes is test."""
    masks = torch.zeros(3, num_splits, num_nodes, dtype=torch.bool)
    n_train, n_val = int(round(train * num_nodes)), int(round(val * num_nodes))
    for split in range(num_splits):
        order = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed + split))
        masks[0, split, order[:n_train]] = True
        masks[1, split, order[n_train:n_train + n_val]] = True
        masks[2, split, order[n_train + n_val:]] = True
    return masks[0], masks[1], masks[2]


def _load_pyg(name: str, root: Path, directed: bool) -> GraphData:
    cls_name, pyg_name, raw = HOMOPHILOUS[name]
    if not (root / raw).is_file():
        raise FileNotFoundError(
            f"load_dataset: {root / raw} not found; put PyG's {cls_name} raw file there "
            f"({cls_name}(root={str(root)!r}{'' if pyg_name is None else f', name={pyg_name!r}'}) reads it); "
            "nothing is downloaded")
    import torch_geometric.datasets as pyg_datasets

    if cls_name == "WikiCS":
        data = pyg_datasets.WikiCS(str(root / "WikiCS"), is_undirected=not directed)[0]
        train, val = data.train_mask.t(), data.val_mask.t()
        test = data.test_mask.unsqueeze(0).expand_as(train)
    else:
        data = getattr(pyg_datasets, cls_name)(str(root), pyg_name)[0]
        train, val, test = random_splits(data.num_nodes)
    return GraphData(name, data.edge_index, data.num_nodes, data.x.float(), data.y.long(),
                     train.contiguous(), val.contiguous(), test.contiguous())


def load_dataset(name: str, data_root: str | os.PathLike | None = None, *, directed: bool = False,
                 self_loops: str = "keep") -> GraphData:
    """Load one of :data:`DATASETS` from ``data_root`` (default: ``nt_kernels.data.default_data_root()``).

    ``directed=False`` makes the graph undirected (every edge stored both ways,
    duplicates removed), as NT uses it; ``directed=True`` keeps the stored edge
    directions, for DirNT.  ``self_loops`` is ``keep``, ``add`` (one loop per
    node, existing loops first removed) or ``remove``.  Masks are (splits, N).
    """
    if name not in DATASETS:
        raise ValueError(f"load_dataset: unknown dataset {name!r}; choose from {DATASETS}")
    if self_loops not in SELF_LOOPS:
        raise ValueError(f"load_dataset: self_loops must be one of {SELF_LOOPS}, got {self_loops!r}")
    root = Path(data_root) if data_root is not None else default_data_root()
    if name in HETEROPHILOUS:
        data = load_npz(_heterophilous_path(name, root))
        data.name = name
    else:
        data = _load_pyg(name, root, directed)
    edge_index = data.edge_index
    if not directed:
        edge_index = to_undirected(edge_index, data.num_nodes)
    if self_loops != "keep":
        from torch_geometric.utils import add_self_loops, remove_self_loops

        edge_index = remove_self_loops(edge_index)[0]
        if self_loops == "add":
            edge_index = add_self_loops(edge_index, num_nodes=data.num_nodes)[0]
    data.edge_index = edge_index
    return data


def monophily_graph(num_nodes: int = 600, num_classes: int = 3, degree: int = 6, *, features: int = 8,
                    signal: float = 0.6, purity: float = 0.9, seed: int = 0) -> GraphData:
    """A small seeded graph with monophily: neighbours mostly of other classes, two-hop neighbours alike.

    Every node j picks a target class t_j != y_j and links to ``degree`` nodes,
    each of class t_j with probability ``purity`` (else any node); edges are
    stored both ways.  So the neighbourhood of j is mostly one class other than
    j's own, and nodes sharing a neighbour mostly share their class.  Features
    are a weak class signal (``signal`` x one-hot label in the first
    ``num_classes`` of ``features`` channels) plus unit Gaussian noise.  One
    split: 50% train, 25% validation, 25% test.
    """
    if num_classes < 2 or num_nodes < 2 * num_classes or degree < 1 or features < num_classes:
        raise ValueError("monophily_graph: need num_classes >= 2, num_nodes >= 2 * num_classes, degree >= 1 "
                         f"and features >= num_classes, got {num_nodes=}, {num_classes=}, {degree=}, {features=}")
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(num_nodes) % num_classes
    y = y[torch.randperm(num_nodes, generator=gen)]
    target = (y + torch.randint(1, num_classes, (num_nodes,), generator=gen)) % num_classes
    by_class = [torch.nonzero(y == c).flatten() for c in range(num_classes)]
    class_size = torch.tensor([len(members) for members in by_class])
    pick = (torch.rand(num_nodes, degree, generator=gen) * class_size[target].unsqueeze(1)).long()
    members = torch.stack([torch.cat([m, m.new_zeros(class_size.max() - len(m))]) for m in by_class])
    chosen = members[target.unsqueeze(1), pick]
    anywhere = torch.randint(0, num_nodes, (num_nodes, degree), generator=gen)
    chosen = torch.where(torch.rand(num_nodes, degree, generator=gen) < purity, chosen, anywhere)
    centre = torch.arange(num_nodes).repeat_interleave(degree)
    edges = torch.stack([centre, chosen.flatten()])
    edges = to_undirected(edges[:, edges[0] != edges[1]], num_nodes)
    x = torch.randn(num_nodes, features, generator=gen)
    x[:, :num_classes] += signal * torch.nn.functional.one_hot(y, num_classes)
    order = torch.randperm(num_nodes, generator=gen)
    masks = torch.zeros(3, 1, num_nodes, dtype=torch.bool)
    for i, part in enumerate(order.tensor_split([num_nodes // 2, 3 * num_nodes // 4])):
        masks[i, 0, part] = True
    return GraphData("monophily", edges, num_nodes, x, y, masks[0], masks[1], masks[2])
