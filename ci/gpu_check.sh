#!/usr/bin/env bash
# On a machine with an accelerator (CUDA, ROCm, XPU, ...) and a torch built for it: the real-device tests (none may
# be skipped) and the staging tests, then the staging benchmark (host-to-device streaming vs the disk's read speed
# vs torch.load). The async-IO op is built on first use (a compiler and libaio/liburing headers are needed).
#   bash ci/gpu_check.sh [--size 1G] [--rounds 3]      DEEPOFFLOAD_BENCH_DIR: folder on the disk to measure
# Exit status 3 when torch sees no accelerator.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
if ! "$PYTHON" -c "import sys, torch; d = torch.accelerator.current_accelerator(check_available=True); print('accelerator:', d, torch.__version__); sys.exit(d is None)"; then
    echo "gpu_check: torch sees no accelerator here" >&2
    exit 3
fi
log=$(mktemp)
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/io/test_device_real.py | tee "$log"
if grep -q "skipped" "$log"; then
    echo "gpu_check: real-device tests were skipped on a machine with an accelerator" >&2
    exit 1
fi
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/io/test_device_staging.py
"$PYTHON" benchmarks/device_staging.py --path "${DEEPOFFLOAD_BENCH_DIR:-${TMPDIR:-/tmp}}" "$@"
