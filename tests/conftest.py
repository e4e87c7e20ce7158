"""Shared fixtures. The op is built once per test session into one cache directory (``DEEPOFFLOAD_CACHE_DIR`` if
set, else a per-user folder under the temp dir that later runs reuse), and scratch files live on a real disk so
O_DIRECT is exercised (``DEEPOFFLOAD_TEST_DIR`` to choose one)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

os.environ.setdefault(
    "DEEPOFFLOAD_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"deepoffload-test-cache-{os.getuid()}")
)


def _prebuilt_installed() -> bool:
    from deepoffload.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().prebuilt_matches()


# For tests of what happens when the op must be built here: with a prebuilt op installed (ci/prebuild.sh runs the
# suite against one) it is usable without a compiler, and the report rightly says so.
without_prebuilt_op = pytest.mark.skipif(_prebuilt_installed(), reason="a prebuilt op is installed")


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the tests as in a terminal, also when the suite was started in the background
    of a non-interactive shell (which starts it with SIGINT ignored, so Python installs no handler)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def aio():
    """The native async-IO module (built on first use)."""
    from deepoffload.io.native import native

    return native()


@pytest.fixture
def scratch(tmp_path_factory) -> Iterator[Path]:
    """A fresh folder on a filesystem that accepts O_DIRECT (not tmpfs), removed after the test."""
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=base, prefix="scratch-"))
    else:
        folder = tmp_path_factory.mktemp("scratch")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def handle(aio):
    from deepoffload import AsyncIOHandle

    with AsyncIOHandle() as h:
        yield h


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"{what} failed: {' '.join(command)}: {proc.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Callable[..., Path]]:
    """A factory mounting a small filesystem: ``small_fs(nbytes, kind, read_only=False)`` with kind ``"ext4"`` (a
    loop-mounted image, accepts O_DIRECT), ``"tmpfs"`` (O_DIRECT since Linux 6.6) or ``"ramfs"`` (no O_DIRECT, no
    size limit). Unmounted after the test. Needs root: skipped with the reason otherwise, or when this machine cannot
    mount (no loop devices, in a container)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mounts: list[Path] = []

    def mount(nbytes: int, kind: str = "ext4", read_only: bool = False) -> Path:
        point = tmp_path / f"mnt-{len(mounts)}"
        point.mkdir()
        ro = ["-o", "ro"] if read_only else []
        try:
            if kind in ("tmpfs", "ramfs"):
                size = ["-o", f"size={nbytes}"] if kind == "tmpfs" else []
                _run(["mount", "-t", kind, *size, *ro, kind, str(point)], f"mounting a {kind}")
            else:
                image = tmp_path / f"fs-{len(mounts)}.img"
                with open(image, "wb") as f:
                    f.truncate(nbytes)
                # no journal, no reserved blocks: the free space is (nearly) all usable and fills predictably
                _run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image)], "mkfs.ext4")
                _run(["mount", "-o", "loop", *ro, str(image), str(point)], "loop-mounting an ext4 image")
        except (OSError, FileNotFoundError) as e:
            pytest.skip(f"cannot mount a small {kind} here: {e}")
        mounts.append(point)
        return point

    yield mount
    for point in reversed(mounts):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
