#!/usr/bin/env bash
# Cross-compiles the native core (every csrc/aio/*.cpp except binding.cpp and
# *_posix.cpp, the files a Windows build uses) with MinGW-w64 into two static
# Windows programs, test_core.exe (tests/native/test_core.cpp, the portable
# tests) and test_windows.exe (tests/native/test_windows.cpp), and runs both
# under Wine.
# Usage: tests/native/build_windows.sh [output-directory]   (default: a temporary folder)
#   RUN=0        build only
#   PYTHON=...   interpreter that runs `python -m op_builder flags --warnings` (default python3)
#   CXX=...      compiler (default x86_64-w64-mingw32-g++-posix: std::thread needs
#                the posix thread model in GCC 12's MinGW; the win32 one lacks it)
#   TEST_DIR=... Unix directory the tests write in (default: a temporary folder under /tmp)
#   FULL_DIR=... Unix directory on a small volume, for a real disk-full write (optional)
# Debian packages: g++-mingw-w64-x86-64 wine
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
CXX="${CXX:-x86_64-w64-mingw32-g++-posix}"

work="$(mktemp -d /tmp/deepoffload-windows.XXXXXX)"
trap 'rm -rf "$work"' EXIT
out="${1:-$work}"
mkdir -p "$out"

sources=()
for f in "$repo"/csrc/aio/*.cpp; do
  case "$(basename "$f")" in binding.cpp|*_posix.cpp) continue ;; esac
  sources+=("$f")
done

# The warnings of every build of the core, from the builder (its probes test the host compiler, not this one).
eval "warnings=($(cd "$repo" && "${PYTHON:-python3}" -m op_builder flags --warnings))"
flags=(-O2 -std=c++17 "${warnings[@]}" -Werror -D_WIN32_WINNT=0x0602)
echo "compiling with $CXX: ${sources[*]##*/}"
objects=()
for f in "${sources[@]}" "$here/test_core.cpp" "$here/test_windows.cpp"; do
  o="$work/$(basename "${f%.cpp}").o"
  "$CXX" "${flags[@]}" -c "$f" -o "$o" &
  objects+=("$o")
done
wait_all() { local rc=0; for job in $(jobs -p); do wait "$job" || rc=1; done; return $rc; }
wait_all
core=("${objects[@]:0:${#sources[@]}}")
"$CXX" -static "${core[@]}" "$work/test_core.o" -o "$out/test_core.exe"
"$CXX" -static "${core[@]}" "$work/test_windows.o" -o "$out/test_windows.exe"
echo "built $out/test_core.exe $out/test_windows.exe"
[[ "${RUN:-1}" == "1" ]] || exit 0

test_dir="${TEST_DIR:-$work}"
# A private Wine prefix keeps the run independent of ~/.wine; Wine creates it on first use (slow once).
export WINEPREFIX="${WINEPREFIX:-$work/wineprefix}" WINEDEBUG="${WINEDEBUG:--all}"
# Wine maps the Unix root to drive Z:, so Unix directories are usable as Z:<path>.
rc=0
wine "$out/test_core.exe" "Z:$test_dir" || rc=1
wine "$out/test_windows.exe" "Z:$test_dir" ${FULL_DIR:+"Z:$FULL_DIR"} || rc=1
exit $rc
