"""Messages packed by centre node: the CSR layout every kernel reads (DESIGN §3)."""
from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["NeighbourhoodCSR", "check_rowptr_values", "receiver_csr", "reversed_csr", "split_segments"]


def check_rowptr_values(op: str, rowptr: torch.Tensor, num_rows: int) -> None:
    """Value checks of a CSR row pointer (one host sync): rowptr[0] = 0, non-decreasing, rowptr[-1] = E."""
    first, last, min_step = torch.stack(
        [rowptr[0], rowptr[-1], torch.diff(rowptr).min() if rowptr.numel() > 1 else rowptr[0] * 0]
    ).tolist()
    if first != 0:
        raise ValueError(f"{op}: rowptr[0] must be 0, got {first}")
    if min_step < 0:
        raise ValueError(f"{op}: rowptr must be non-decreasing")
    if last != num_rows:
        raise ValueError(f"{op}: rowptr[-1] must equal the number of packed rows E = {num_rows}, got {last}")


def _check_fields(rowptr, perm, receiver, num_nodes, max_degree) -> None:
    """Checks of a directly built :class:`NeighbourhoodCSR` (structure first, then values with one host sync)."""
    op = "NeighbourhoodCSR"
    for name, value in (("num_nodes", num_nodes), ("max_degree", max_degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{op}: {name} must be an int >= 0, got {value!r}")
    for name, t in (("rowptr", rowptr), ("perm", perm), ("receiver", receiver)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{op}: {name} must be a 1-D int64 tensor, got shape {tuple(t.shape)} {t.dtype}")
        if t.device != rowptr.device:
            raise ValueError(f"{op}: {name} is on {t.device} but rowptr is on {rowptr.device}")
    if rowptr.numel() != num_nodes + 1:
        raise ValueError(f"{op}: rowptr must have num_nodes + 1 = {num_nodes + 1} entries, got {rowptr.numel()}")
    num_rows = perm.numel()
    if receiver.numel() != num_rows:
        raise ValueError(f"{op}: receiver must have E = {num_rows} entries (perm's length), got {receiver.numel()}")
    check_rowptr_values(op, rowptr, num_rows)
    zero = rowptr[:1].sum() * 0
    largest, bad_perm, low_receiver = torch.stack([
        torch.diff(rowptr).max() if num_nodes else zero,
        (torch.sort(perm).values != torch.arange(num_rows, device=perm.device)).any().long(),
        receiver.min() if num_rows else zero,
    ]).tolist()
    if bad_perm:
        raise ValueError(f"{op}: perm must be a permutation of 0..E-1 (E = {num_rows})")
    if low_receiver < 0:
        raise ValueError(f"{op}: receiver has a negative node index ({low_receiver})")
    if largest != max_degree:
        raise ValueError(f"{op}: max_degree must be the largest segment size {largest}, got {max_degree}")


class NeighbourhoodCSR:
    """A graph's messages packed by centre node.

    Edge e = (centre j, receiver k) of ``edge_index`` (row 0 = centre, row 1 =
    receiver, PyG's source -> target) becomes packed row ``p`` with
    ``perm[p] = e``; rows of centre j are ``rowptr[j]:rowptr[j + 1]`` in their
    original edge order (stable sort).  Execution plans built for this graph
    are cached on the object (``plan``), never in module-level globals.

    Built directly, every field is checked (one host sync): ``rowptr`` (N+1,)
    int64 from 0 to E, non-decreasing; ``perm`` (E,) int64 a permutation of
    0..E-1; ``receiver`` (E,) int64 non-negative; all on one device;
    ``max_degree`` the largest segment size.  :meth:`from_edge_index` builds
    valid fields by construction.
    """

    def __init__(self, rowptr: torch.Tensor, perm: torch.Tensor, receiver: torch.Tensor,
                 num_nodes: int, max_degree: int):
        _check_fields(rowptr, perm, receiver, num_nodes, max_degree)
        self._set(rowptr, perm, receiver, num_nodes, max_degree)

    def _set(self, rowptr, perm, receiver, num_nodes, max_degree) -> None:
        self.rowptr = rowptr
        self.perm = perm
        self.receiver = receiver
        self.num_nodes = num_nodes
        self.max_degree = max_degree
        self._plans: dict = {}

    @classmethod
    def _trusted(cls, rowptr, perm, receiver, num_nodes: int, max_degree: int) -> "NeighbourhoodCSR":
        """A CSR from fields valid by construction (the factories below), without the checks."""
        csr = cls.__new__(cls)
        csr._set(rowptr, perm, receiver, num_nodes, max_degree)
        return csr

    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor, num_nodes: int | None = None) -> "NeighbourhoodCSR":
        """Pack ``edge_index`` (2, E) by centre node with a stable sort on its device."""
        op = "NeighbourhoodCSR.from_edge_index"
        if not isinstance(edge_index, torch.Tensor):
            raise TypeError(f"{op}: edge_index must be a torch.Tensor, got {type(edge_index).__name__}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"{op}: edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: edge_index must be int32 or int64, got {edge_index.dtype}")
        if num_nodes is not None and (isinstance(num_nodes, bool) or not isinstance(num_nodes, int)):
            raise TypeError(f"{op}: num_nodes must be an int or None, got {type(num_nodes).__name__}")
        if num_nodes is not None and num_nodes < 0:
            raise ValueError(f"{op}: num_nodes must be non-negative, got {num_nodes}")
        edge_index = edge_index.long()
        num_edges = edge_index.shape[1]
        if num_edges:
            lo, hi = torch.stack([edge_index.min(), edge_index.max()]).tolist()
            if lo < 0:
                raise ValueError(f"{op}: edge_index has a negative node index ({lo})")
            if num_nodes is None:
                num_nodes = hi + 1
            elif hi >= num_nodes:
                raise ValueError(f"{op}: edge_index has node index {hi} out of range for num_nodes={num_nodes}")
        elif num_nodes is None:
            num_nodes = 0
        centre, receiver = edge_index[0], edge_index[1]
        perm = torch.sort(centre, stable=True).indices
        degree = torch.bincount(centre, minlength=num_nodes)
        rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=edge_index.device)
        torch.cumsum(degree, 0, out=rowptr[1:])
        max_degree = int(degree.max()) if num_nodes else 0
        return cls._trusted(rowptr, perm, receiver[perm], num_nodes, max_degree)

    # ------------------------------------------------------------------ sizes
    @property
    def num_edges(self) -> int:
        return self.perm.numel()

    @property
    def device(self) -> torch.device:
        return self.rowptr.device

    @property
    def degree(self) -> torch.Tensor:
        """(N,) number of packed rows (messages) of every centre node."""
        return torch.diff(self.rowptr)

    @property
    def centre(self) -> torch.Tensor:
        """(E,) segment id (centre node) of every packed row."""
        return self.plan("centre", lambda: torch.repeat_interleave(
            torch.arange(self.num_nodes, device=self.device), self.degree, output_size=self.num_edges))

    @property
    def size_hist(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sizes, counts): distinct segment sizes in increasing order and how many segments have each."""
        return self.plan("size_hist", lambda: torch.unique(self.degree, return_counts=True))

    # ---------------------------------------------------------------- packing
    def pack(self, edge_tensor: torch.Tensor) -> torch.Tensor:
        """Reorder a per-edge tensor (E, ...) in original edge order into packed order."""
        self._check_rows("pack", edge_tensor)
        return edge_tensor.index_select(0, self.perm)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`: packed rows back to original edge order (differentiable)."""
        self._check_rows("unpack", packed)
        return packed.new_zeros(packed.shape).index_copy(0, self.perm, packed)

    def _check_rows(self, op: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != self.num_edges:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"NeighbourhoodCSR.{op}: expected a tensor with E = {self.num_edges} rows, got {shape}")
        if t.device != self.device:
            raise ValueError(f"NeighbourhoodCSR.{op}: tensor is on {t.device}, the graph on {self.device}")

    # ------------------------------------------------------------------ plans
    def plan(self, key, build: Callable[[], object]):
        """Cached per-graph execution plan: ``build()`` runs once per ``key``."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def segment_split(self, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ids taking exact attention (size <= threshold) and Performer (size > threshold)."""
        return self.plan(("split", float(threshold)), lambda: split_segments(self.rowptr, threshold))

    def to(self, device) -> "NeighbourhoodCSR":
        """A copy on ``device`` (plans are rebuilt there lazily)."""
        device = torch.device(device)
        return NeighbourhoodCSR._trusted(self.rowptr.to(device), self.perm.to(device), self.receiver.to(device),
                                         self.num_nodes, self.max_degree)

    def __repr__(self) -> str:
        return (f"NeighbourhoodCSR(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"max_degree={self.max_degree}, device={self.device})")


def split_segments(rowptr: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split segment ids by size: (n <= threshold, n > threshold). Empty segments go nowhere."""
    sizes = torch.diff(rowptr)
    if math.isinf(threshold) and threshold > 0:
        large = torch.zeros_like(sizes, dtype=torch.bool)
    else:
        large = sizes > threshold
    small = (sizes > 0) & ~large
    return small.nonzero().flatten(), large.nonzero().flatten()


def receiver_csr(csr: NeighbourhoodCSR, num_nodes: int) -> NeighbourhoodCSR:
    """The packed rows of ``csr`` regrouped by receiver, over ``num_nodes`` receivers.

    In the result, segment i holds the messages arriving at node i, its ``perm``
    maps each receiver-ordered row to the centre-packed row of ``csr`` it comes
    from, and its ``receiver`` field holds the sending centre.  Cached on ``csr``.
    """
    def build():
        edges = torch.stack([csr.receiver, csr.centre])
        return NeighbourhoodCSR.from_edge_index(edges, num_nodes)
    return csr.plan(("nn.receiver_csr", num_nodes), build)


def reversed_csr(csr: NeighbourhoodCSR, num_nodes: int) -> NeighbourhoodCSR:
    """CSR of the reversed graph (every edge (j, k) becomes (k, j)), with edge ids of the original order.

    Its ``perm`` indexes the original ``edge_index`` columns, so the same
    ``edge_attr`` serves both directions (DirNT).  Cached on ``csr``.
    """
    def build():
        original = csr.unpack(torch.stack([csr.receiver, csr.centre], dim=1))
        return NeighbourhoodCSR.from_edge_index(original.t().contiguous(), num_nodes)
    return csr.plan(("nn.reversed_csr", num_nodes), build)
