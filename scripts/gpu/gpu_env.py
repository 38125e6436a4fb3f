"""Stage 1 of scripts/gpu/gpu_check.sh: versions, the device, the extension and the data, as text and JSON.

Fails (exit 1) when nt_kernels or its compiled extension does not import, when
torch has CUDA but the extension was built without it, or when a small CUDA
Performer call (no Triton compile needed) does not run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for name in ("triton", "torch_geometric", "numpy", "pytest", "xdist"):
        try:
            out[name] = getattr(__import__(name), "__version__", "present")
        except ImportError:
            out[name] = None
    return out


def device() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False}
    p = torch.cuda.get_device_properties(0)
    return {"cuda": True, "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1), "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
            "shared_memory_per_block_optin": getattr(p, "shared_memory_per_block_optin", None)}


def performer_smoke() -> str:
    """One CUDA Performer forward + backward against the loop reference (no Triton involved)."""
    from nt_kernels import default_nb_features, orthogonal_random_features, segment_performer_attention
    from nt_reference import ops as ref

    gen = torch.Generator().manual_seed(0)
    rowptr = torch.tensor([0, 3, 3, 300, 310]).cuda()
    q, k, v = (torch.randn(310, 2, 16, generator=gen, dtype=torch.float64).cuda().requires_grad_() for _ in range(3))
    p = orthogonal_random_features(default_nb_features(16), 16, generator=gen, dtype=torch.float64).cuda()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o = segment_performer_attention(*leaves, rowptr, p.float())
    o.sum().backward()
    want = ref.segment_performer_attention(q, k, v, rowptr, p)
    want.sum().backward()
    errors = [(o.double() - want).abs().max().item()] + [(a.grad.double() - b.grad).abs().max().item()
                                                          for a, b in zip(leaves, (q, k, v))]
    if not all(e < 1e-3 for e in errors):
        raise RuntimeError(f"CUDA Performer smoke test: max errors {errors}")
    return f"ok (max errors o, dq, dk, dv: {', '.join(f'{e:.1e}' for e in errors)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    doc = {"versions": versions(), "device": device()}
    print(json.dumps(doc, indent=1))
    import nt_kernels
    from nt_kernels._extension import extension
    from nt_kernels.cli import kernel_table, run_info

    build = extension().build_info()
    doc.update(nt_kernels=nt_kernels.__version__, extension=build, extension_path=extension().__file__,
               kernels=kernel_table())
    run_info(argparse.Namespace())
    if torch.version.cuda and not build["cuda"]:
        print("gpu_env: torch has CUDA but the extension was built without the CUDA sources")
        return 1
    from nt_kernels.data import DATA_ROOT_ENV, load_npz

    doc["data"] = {}
    for name in ("tolokers", "minesweeper"):
        try:
            g = load_npz(name)
            doc["data"][name] = {"nodes": g.num_nodes, "edges": g.num_edges}
        except FileNotFoundError as exc:
            doc["data"][name] = f"missing: {exc}"
    print(f"data (${DATA_ROOT_ENV}={os.environ.get(DATA_ROOT_ENV)}): {doc['data']}")
    if torch.cuda.is_available():
        doc["performer_smoke"] = performer_smoke()
        print(f"CUDA Performer smoke test: {doc['performer_smoke']}")
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
