"""Data root: found through --data-root / data_root= / $NT_KERNELS_DATA only, never from the package's location."""
import os

import pytest

from nt_kernels.data import DATA_ROOT_ENV, default_data_root, load_dataset, load_npz


def test_data_root_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    assert default_data_root() == tmp_path


def test_missing_data_root_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"no data root: pass root= / data_root= \(--data-root .*\) or set "
                                                r"\$NT_KERNELS_DATA"):
        default_data_root()
    with pytest.raises(FileNotFoundError, match="no data root"):
        load_npz("minesweeper")
    with pytest.raises(FileNotFoundError, match="no data root"):
        load_dataset("minesweeper")


def test_explicit_root_needs_no_environment(monkeypatch):
    real = os.environ[DATA_ROOT_ENV]  # set by conftest.py when unset
    monkeypatch.delenv(DATA_ROOT_ENV)
    data = load_npz("minesweeper", root=real)
    assert data.num_nodes == 10_000
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_npz("minesweeper", root="/nonexistent-nt-kernels-root")
