"""The ``nt-kernels`` command: info, check, demo, bench, results, train, tune."""
from __future__ import annotations

import argparse
import platform
import sys

import torch

import nt_kernels
from nt_kernels._extension import build_info, cpu_paths, extension

KERNEL_OPS = {
    "exact": ("softmax_fwd_into", "softmax_bwd_into"),
    "performer": ("performer_fwd_into", "performer_bwd_into"),
}
KERNEL_NAMES = {
    ("exact", "CPU"): "C++ (csrc/cpu/segment_softmax_kernel.cpp)",
    ("performer", "CPU"): "C++ (csrc/cpu/segment_performer_kernel.cpp)",
    ("exact", "CUDA"): "Triton (nt_kernels/backends/triton)",
    ("performer", "CUDA"): "CUDA (csrc/cuda/segment_performer_kernel.cu)",
}


def kernel_table() -> dict[str, dict[str, str]]:
    """Which implementation serves each kernel on each device, read from the dispatcher."""
    table: dict[str, dict[str, str]] = {}
    for kind, ops in KERNEL_OPS.items():
        table[kind] = {}
        for key in ("CPU", "CUDA"):
            registered = all(torch._C._dispatch_has_kernel_for_dispatch_key(f"nt_kernels::{name}", key)
                             for name in ops)
            table[kind][key] = KERNEL_NAMES[(kind, key)] if registered else "not available"
    return table


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def run_info(args: argparse.Namespace) -> int:
    build = extension().build_info()
    print(f"nt-kernels {nt_kernels.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
          f"torch_geometric {_version('torch_geometric')}")
    info = build_info()
    cuda = f"built (CUDA {info.CUDA}, architectures {info.CUDA_ARCHS})" if info and info.CUDA else "built"
    print(f"extension built against torch {build['torch']} with {build['compiler']}, "
          f"OpenMP {build['openmp']}, CUDA sources {cuda if build['cuda'] else 'not built'}")
    paths = cpu_paths()
    print(f"CPU: {torch.get_num_threads()} threads; torch CPU capability {paths['torch_capability']} "
          f"(ATEN_CPU_CAPABILITY; this CPU: {', '.join(paths['torch_capabilities'])}); nt_kernels CPU ISA path "
          f"{paths['nt_kernels_isa']} (NT_KERNELS_CPU_ISA; this CPU: {', '.join(paths['nt_kernels_isa_paths'])})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"CUDA device {i}: {torch.cuda.get_device_name(i)}")
    else:
        print("CUDA: no device")
    for kind, devices in kernel_table().items():
        for device, impl in devices.items():
            print(f"{kind:9s} kernel on {device:4s}: {impl}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nt_kernels.apps import check, demo, results_page, train, tune
    from nt_kernels.bench import cli as bench

    parser = argparse.ArgumentParser(
        prog="nt-kernels", description="Padding-free kernels for Neighbourhood Transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and which kernels are built and used")
    info.set_defaults(func=run_info)
    check.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    results_page.add_parser(sub)
    train.add_parser(sub)
    tune.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
