#!/usr/bin/env bash
# Builds the native core with its test programs and runs them: the planning unit tests, then the core on a real disk.
# Usage: tests/native/build_and_run.sh [test-directory]
#   SANITIZE=1   build with -fsanitize=address,undefined
#   CXX=...      compiler (default g++)
#   ENGINES="posix"  restrict features (any of: libaio io_uring); default: probe
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

probe() {  # probe <name> <source> <libs>: compiles and links a tiny program
  printf '%s\n' "$2" > "$work/probe_$1.cpp"
  "$CXX" -std=c++17 "$work/probe_$1.cpp" -o "$work/probe_$1" $3 >/dev/null 2>&1
}

defs=()
libs=()
want="${ENGINES:-libaio io_uring}"
if [[ " $want " == *" libaio "* ]] && probe aio '#include <libaio.h>
int main() { io_context_t c = 0; return io_setup(1, &c) < 0 ? 0 : io_destroy(c); }' -laio; then
  defs+=(-DDEEPOFFLOAD_HAVE_LIBAIO)
  libs+=(-laio)
  if probe pgetevents '#include <libaio.h>
int main() { io_context_t c = 0; return io_pgetevents(c, 0, 0, 0, 0, 0); }' -laio; then
    defs+=(-DDEEPOFFLOAD_HAVE_PGETEVENTS)
  fi
fi
if [[ " $want " == *" io_uring "* ]] && probe uring '#include <liburing.h>
int main() { struct io_uring r; return io_uring_queue_init(1, &r, 0) < 0 ? 0 : (io_uring_queue_exit(&r), 0); }' -luring; then
  defs+=(-DDEEPOFFLOAD_HAVE_URING)
  libs+=(-luring)
fi

flags=(-O2 -std=c++17 -Wall -Wextra -Werror -pthread)
if [[ "${SANITIZE:-0}" == "1" ]]; then
  flags+=(-g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
fi

sources=()
for f in "$repo"/csrc/aio/*.cpp; do
  case "$(basename "$f")" in binding.cpp|*_windows.cpp) continue ;; esac
  sources+=("$f")
done

echo "features: ${defs[*]:-(posix only)}"
# The planning unit tests first: pure functions, no IO.
"$CXX" "${flags[@]}" "$repo/csrc/aio/plan.cpp" "$here/test_plan.cpp" -o "$work/test_plan"
"$work/test_plan"
"$CXX" "${flags[@]}" "${defs[@]}" "${sources[@]}" "$here/test_core.cpp" -o "$work/test_core" "${libs[@]}"
"$work/test_core" "$work"
