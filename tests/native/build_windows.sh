#!/usr/bin/env bash
# Cross-compiles the native core (every csrc/aio/*.cpp except binding.cpp and
# *_posix.cpp, as the Windows build does) with tests/native/test_core.cpp into a
# static Windows executable with MinGW-w64, and runs it under Wine.
# Usage: tests/native/build_windows.sh [output.exe]   (default: a temporary folder)
#   RUN=0        build only
#   CXX=...      compiler (default x86_64-w64-mingw32-g++-posix: std::thread needs
#                the posix thread model in GCC 12's MinGW; the win32 one lacks it)
#   TEST_DIR=... directory the test writes in (default: a temporary folder under /tmp)
# Debian packages: g++-mingw-w64-x86-64 wine
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
CXX="${CXX:-x86_64-w64-mingw32-g++-posix}"

work="$(mktemp -d /tmp/deepoffload-windows.XXXXXX)"
trap 'rm -rf "$work"' EXIT
exe="${1:-$work/test_core.exe}"

sources=()
for f in "$repo"/csrc/aio/*.cpp; do
  case "$(basename "$f")" in binding.cpp|*_posix.cpp) continue ;; esac
  sources+=("$f")
done

flags=(-static -O2 -std=c++17 -Wall -Wextra -Werror -D_WIN32_WINNT=0x0602)
echo "compiling: ${sources[*]##*/} test_core.cpp"
"$CXX" "${flags[@]}" "${sources[@]}" "$here/test_core.cpp" -o "$exe"
[[ "${RUN:-1}" == "1" ]] || exit 0

test_dir="${TEST_DIR:-$work}"
# A private Wine prefix keeps the run independent of ~/.wine; Wine creates it on first use (slow once).
export WINEPREFIX="${WINEPREFIX:-$work/wineprefix}" WINEDEBUG="${WINEDEBUG:--all}"
# Wine maps the Unix root to drive Z:, so the Unix directory is usable as is.
exec wine "$exe" "Z:$test_dir"
