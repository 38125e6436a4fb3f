#!/usr/bin/env bash
# `make wheel-check`: the wheel of dist/ for PYTHON and its torch (built by `make wheel`), as a
# user gets it.  Its files first (scripts/wheel_check.py contents); then a fresh venv outside the
# checkout with torch (the version PYTHON has: the pinned CPU build here) and the wheel's other
# runtime dependencies, the wheel installed with --no-deps (timed, as is the first import), and
# from a folder outside the checkout: scripts/wheel_check.py installed, `nt-kernels info`,
# `nt-kernels check --quick --device cpu` and a 2-epoch `nt-kernels train` on minesweeper.
#
# Environment: PYTHON (default python3), WHEEL (default: scripts/wheel_check.py find dist),
# WHEEL_VENV (the folder for the venv and the runs; default a new one under /tmp, removed after a
# pass), NT_KERNELS_DATA (the real graphs; the Makefile sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
step() {  # step NAME COMMAND...: runs it, then prints its seconds
  local t0=$SECONDS name=$1
  shift
  "$@"
  echo "wheel_smoke: $name: $((SECONDS - t0)) s"
}
PYTHON=${PYTHON:-python3}
wheel=${WHEEL:-$("$PYTHON" scripts/wheel_check.py find dist)}
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
"$PYTHON" scripts/wheel_check.py contents "$wheel"

work=${WHEEL_VENV:-$(mktemp -d /tmp/nt-wheel-check.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
case "$work/" in "$repo"/*) echo "wheel_smoke: WHEEL_VENV must be outside the checkout" >&2; exit 1 ;; esac
venv=$work/venv
torch_version=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
# The wheel's runtime dependencies (its METADATA, extras left out) with torch pinned to PYTHON's.
mapfile -t deps < <("$PYTHON" - "$wheel" <<'PY'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        req = line.split(":", 1)[1].strip()
        if re.split(r"[<>=!~ ;\[]", req)[0].lower() != "torch":
            print(req)
PY
)
echo "wheel_smoke: fresh venv $venv: torch==$torch_version ${deps[*]}"
step "fresh venv with torch and the dependencies" \
  bash -c '"$1" -m venv --clear "$2" && "$2/bin/python" -m pip install -q "${@:3}"' _ "$PYTHON" "$venv" \
  "torch==$torch_version" "${deps[@]}"

cd "$work"  # outside the checkout from here on
t0=$(date +%s.%N)
"$venv/bin/python" -m pip install -q --no-deps "$wheel"
t1=$(date +%s.%N)
"$venv/bin/python" -c "import nt_kernels, nt_kernels.ops"
t2=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v c="$t2" \
  'BEGIN { printf "wheel_smoke: pip install --no-deps of the wheel %.1f s, first import %.1f s, together %.1f s\n", b - a, c - b, c - a }'
"$venv/bin/python" "$repo/scripts/wheel_check.py" installed --checkout "$repo"
"$venv/bin/nt-kernels" info
step "nt-kernels check --quick" "$venv/bin/nt-kernels" check --quick --device cpu
step "nt-kernels train, 2 epochs" "$venv/bin/nt-kernels" train --dataset minesweeper --splits 0 --epochs 2 \
  --no-progress --out "$work/train.json"
echo "wheel_smoke: $(basename "$wheel") installed in a fresh venv: check --quick and 2 training epochs passed" \
  "($((SECONDS - start)) s in all)"
[ -n "${WHEEL_VENV:-}" ] || rm -rf "$work"
