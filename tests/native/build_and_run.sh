#!/usr/bin/env bash
# Builds the native core with its test programs and runs them: the planning unit tests, then the core on a real disk.
# Usage: tests/native/build_and_run.sh [test-directory]
#   SANITIZE=1   build with -fsanitize=address,undefined
#   CXX=...      compiler (default g++)
#   ENGINES="posix"  restrict features (any of: libaio io_uring); default: what the builder's probes find
#   PYTHON=...   interpreter that runs `python -m op_builder flags` (default python3)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
CXX="${CXX:-g++}"

# Build and test outside tmpfs: O_DIRECT needs a real file system.
base="${1:-}"
if [[ -z "$base" ]]; then
  if [[ "$(stat -f -c %T /tmp 2>/dev/null)" == "tmpfs" ]]; then base="$repo"; else base="/tmp"; fi
fi
work="$(mktemp -d "$base/deepoffload-native.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# The flags and features of the JIT build, from the builder's own probes (cached on disk).
without=()
want="${ENGINES:-libaio io_uring}"
[[ " $want " == *" libaio "* ]] || without+=(--without libaio)
[[ " $want " == *" io_uring "* ]] || without+=(--without liburing)
sanitize=()
[[ "${SANITIZE:-0}" == "1" ]] && sanitize=(DEEPOFFLOAD_SANITIZE=address,undefined)
op_flags() { (cd "$repo" && env "${sanitize[@]}" CXX="$CXX" "${PYTHON:-python3}" -m op_builder flags "$@" "${without[@]}"); }
cflags_line="$(op_flags --cflags)"
ldflags_line="$(op_flags --ldflags)"
eval "cflags=($cflags_line)"  # shell-quoted by the builder
eval "libs=($ldflags_line)"

flags=("${cflags[@]}" -Werror -pthread)
if [[ "${SANITIZE:-0}" == "1" ]]; then
  flags+=(-fno-sanitize-recover=undefined)
fi

sources=()
for f in "$repo"/csrc/aio/*.cpp; do
  case "$(basename "$f")" in binding.cpp|*_windows.cpp) continue ;; esac
  sources+=("$f")
done

echo "engines: $(op_flags --engines)"
# The planning unit tests first: pure functions, no IO.
"$CXX" "${flags[@]}" "$repo/csrc/aio/plan.cpp" "$here/test_plan.cpp" -o "$work/test_plan"
"$work/test_plan"
"$CXX" "${flags[@]}" "${sources[@]}" "$here/test_core.cpp" -o "$work/test_core" "${libs[@]}"
"$work/test_core" "$work"
