"""README's API tour runs (issue 44): every ```python block, in order and in one namespace, as a reader would
paste it.  A block that needs a GPU or a download is skipped with the reason.  Where a line prints with the
expected output in its comment (``print(conv)  # NTConv(...)``), the output must be that comment."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
PRINTS = re.compile(r"^print\(.*\)\s+#\s*(.+)$", re.M)


def skip_reason(block: str) -> str | None:
    if re.search(r"""["']cuda["']|\.cuda\(""", block) and not torch.cuda.is_available():
        return "needs a GPU"
    if re.search(r"download|HeterophilousGraphDataset|load_dataset\(", block):
        return "needs a dataset download or the real graphs"
    return None


def reader_inputs(namespace: dict) -> None:
    """What the tour leaves to the reader: ``data``, a graph of their own (the tour's four nodes with every
    edge stored both ways, as NeighborLoader sampling needs, and 16 features), and ``train_idx``."""
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    namespace.setdefault("data", Data(x=torch.randn(4, 16), edge_index=to_undirected(namespace["edge_index"]),
                                      num_nodes=4))
    namespace.setdefault("train_idx", torch.arange(4))


@pytest.fixture(scope="module")
def tour() -> list[tuple[str, str | None, BaseException | None]]:
    """(printed output, skip reason, exception raised) of every block, run in order in one namespace."""
    torch.manual_seed(0)
    namespace: dict = {"__name__": "readme"}
    outcomes = []
    for i, block in enumerate(BLOCKS):
        reason = skip_reason(block)
        if reason:
            outcomes.append(("", reason, None))
            continue
        if re.search(r"\bdata\b|\btrain_idx\b", block) and "edge_index" in namespace:
            reader_inputs(namespace)
        out, error = io.StringIO(), None
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as exc:  # reported by the block's test
            error = exc
        outcomes.append((out.getvalue(), None, error))
    return outcomes


def test_readme_has_an_api_tour():
    assert len(BLOCKS) >= 3 and "nk.neighbourhood_attention" in BLOCKS[0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_api_tour_block_runs(tour, index):
    printed, reason, error = tour[index]
    if reason:
        pytest.skip(reason)
    if error is not None:
        raise error
    expected = PRINTS.findall(BLOCKS[index])
    if expected:
        assert printed.splitlines() == [line.strip() for line in expected]
