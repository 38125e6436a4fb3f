#!/usr/bin/env bash
# Everything a GPU lease runs, in one command (see docs/results.md, "GPU runs").
#
# Here, before the lease:   bash scripts/gpu_session.sh prepare
#     copies ../shared/data/heterophilous into .gpu-data/ (git-ignored), to be
#     named in the device tool's `carry`.
# On the GPU machine:       bash scripts/gpu_session.sh run [pytest args...]
#     builds the CUDA extension (torch 2.11 + CUDA, no network), runs the whole
#     test suite on the GPU, then `nt-kernels bench` for the GPU result set.
#     Logs and JSON land in $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
shift || true

if [ "$mode" = prepare ]; then
  mkdir -p .gpu-data
  cp ../shared/data/heterophilous/*.npz .gpu-data/
  ls -l .gpu-data
  exit 0
fi

out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NT_KERNELS_DATA="$PWD/.gpu-data"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
NT_KERNELS_CUDA=ON pip install --no-build-isolation --no-deps -e . 2>&1 | tail -5 | tee "$out/build.log"
python -m nt_kernels.cli info 2>&1 | tee "$out/info.txt"
python -m pytest -q -x --durations=15 tests "$@" 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}
bench() {
  python -m nt_kernels.cli bench --device cuda --out "$out" "$@" 2>&1 | tee -a "$out/bench.log"
}
bench --graph minesweeper,tolokers --heads 4 --head-dim 8
bench --graph tolokers --heads 2 --head-dim 32
bench --graph tolokers --heads 4 --head-dim 8 --subset exact --dtype bfloat16
exit "$status"
