#!/usr/bin/env bash
# Builds the async-IO op with AddressSanitizer + UndefinedBehaviorSanitizer into its own cache folder and runs the
# op-level tests under it (tests/io/test_handle.py and tests/reliability, slow ones excluded; extra pytest arguments are
# passed on). Fails when a test fails or when any sanitizer report was written, by this process or any child.
#   PYTHON=...                         interpreter (default: python)
#   DEEPOFFLOAD_SANITIZE=...           sanitizers (default: address,undefined)
#   DEEPOFFLOAD_SANITIZE_CACHE_DIR=... where the sanitizer build is cached (default: a per-user temp folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
CXX="${CXX:-g++}"

export DEEPOFFLOAD_SANITIZE="${DEEPOFFLOAD_SANITIZE:-address,undefined}"
export DEEPOFFLOAD_CACHE_DIR="${DEEPOFFLOAD_SANITIZE_CACHE_DIR:-${TMPDIR:-/tmp}/deepoffload-sanitize-cache-$(id -u)}"
reports="$(mktemp -d "${TMPDIR:-/tmp}/deepoffload-sanitizer-reports.XXXXXX")"

# Python is not built with ASan, so its runtime must be loaded first. Python leaks at exit by design: no leak
# checks. Every report goes to a file in $reports (checked below, so a report in a child process that a test does
# not look at still fails the run) and ends the process with a non-zero status (halt_on_error; no abort, no core).
asan="$("$CXX" -print-file-name=libasan.so)"
if [[ "$asan" != /* ]]; then
  echo "sanitize.sh: $CXX has no libasan.so (install the compiler's sanitizer runtime, e.g. libasan8)" >&2
  exit 2
fi
# libstdc++ too: python does not link it, and ASan resolves its __cxa_throw interceptor at start-up (without it the
# first C++ exception stops the process with "CHECK failed ... real___cxa_throw").
export LD_PRELOAD="$asan:$("$CXX" -print-file-name=libstdc++.so)${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:log_path=$reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87:log_path=$reports/ubsan"

status=0
"$PYTHON" - <<'PY' || status=$?
import os
from deepoffload.io.native import native
module = native()
cache = os.path.realpath(os.environ["DEEPOFFLOAD_CACHE_DIR"])
if not os.path.realpath(module.__file__).startswith(cache + os.sep):
    raise SystemExit(f"sanitize.sh: loaded {module.__file__}, not the sanitizer build in {cache} "
                     f"(is a prebuilt op installed? use an editable install)")
print(f"sanitize.sh: {os.environ['DEEPOFFLOAD_SANITIZE']} build: {module.__file__}")
PY
if [[ $status -eq 0 ]]; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -m "not slow" tests/io/test_handle.py tests/reliability "$@" || status=$?
fi

if compgen -G "$reports/*" >/dev/null; then
  echo "sanitize.sh: sanitizer reports:" >&2
  for report in "$reports"/*; do
    echo "--- $report" >&2
    cat "$report" >&2
  done
  status=1
fi
rm -rf "$reports"
exit $status
