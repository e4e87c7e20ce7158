"""Drives for tests and benchmarks: small filesystems on distinct devices, made and removed by the test.

``Drives(n)`` mounts ``n`` loop-device ext4 filesystems (each its own ``st_dev``, O_DIRECT works on them), each
optionally throttled to ``bps`` bytes per second for reads and writes by a blkio cgroup (v1
``blkio.throttle.{read,write}_bps_device``; only processes inside the cgroup are throttled: ``with drives.throttled():``
moves this process in and back out). ``Drives(n, kind="tmpfs")`` mounts tmpfs instead (no throttle; ``size`` bytes
each, so it fills up: the full-drive case). Both need root (``unavailable()`` says why not, for ``pytest.skip``).
Every mount, loop device, image file and cgroup is removed on exit, also when the body raised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


def unavailable(kind: str = "loop", throttle: bool = False) -> str | None:
    """Why ``Drives`` of ``kind`` cannot be made here, or None when they can.

    Args:
        kind: ``loop`` or ``tmpfs``.
        throttle: Whether a blkio throttle is needed too.

    Returns:
        The reason, or None.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "mounting test drives needs root"
    if kind == "loop":
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        if not os.path.exists("/dev/loop-control"):
            return "no loop devices (/dev/loop-control is missing)"
    if throttle and not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return "no cgroup v1 blkio controller at /sys/fs/cgroup/blkio (needed to throttle the loop devices)"
    with tempfile.TemporaryDirectory() as probe:
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            return f"cannot mount here: {e}"
        subprocess.run(["umount", probe], check=False, capture_output=True)
    return None


def _run(*args: str) -> str:
    return subprocess.run(list(args), check=True, capture_output=True, text=True).stdout.strip()


class Drives:
    """``count`` filesystems on distinct devices, mounted under a temporary folder; ``folders`` lists them.

    Args:
        count: How many drives.
        size: Bytes of each filesystem.
        kind: ``loop`` (ext4 on a loop device over an image file) or ``tmpfs``.
        bps: Throttle each loop device to this many bytes per second (reads and writes) for processes inside
            ``throttled()``; None: no throttle.
        base: Where the mount points and image files go (default: the temp folder).
    """

    def __init__(self, count: int, size: int = 64 << 20, kind: str = "loop", bps: int | None = None, base=None):
        self.count, self.size, self.kind, self.bps = count, size, kind, bps
        self.base = base
        self.folders: list[str] = []
        self.devices: list[str] = []
        self.cgroup: Path | None = None
        self._root: str | None = None
        self._mounted: list[str] = []

    def __enter__(self) -> "Drives":
        self._root = tempfile.mkdtemp(prefix="deepoffload-drives-", dir=self.base)
        try:
            for i in range(self.count):
                mount = os.path.join(self._root, f"drive{i}")
                os.mkdir(mount)
                if self.kind == "tmpfs":
                    _run("mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", mount)
                else:
                    image = os.path.join(self._root, f"drive{i}.img")
                    with open(image, "wb") as f:
                        f.truncate(self.size)
                    _run("mkfs.ext4", "-q", "-F", "-m", "0", image)
                    device = _run("losetup", "-f", "--show", image)
                    self.devices.append(device)
                    _run("mount", device, mount)
                    os.chmod(mount, 0o700)
                self._mounted.append(mount)
                self.folders.append(mount)
            if self.bps is not None and self.devices:
                self.cgroup = BLKIO / f"deepoffload-drives-{os.getpid()}-{os.path.basename(self._root)}"
                self.cgroup.mkdir()
                for device in self.devices:
                    st = os.stat(device)
                    for key in ("read", "write"):
                        limit = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {self.bps}"
                        (self.cgroup / f"blkio.throttle.{key}_bps_device").write_text(limit)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @contextlib.contextmanager
    def throttled(self) -> Iterator[None]:
        """Run the body with this process inside the throttling cgroup (all its threads), then move it back."""
        if self.cgroup is None:
            yield
            return
        before = next(
            (line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if ":blkio:" in line),
            "/",
        )
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (BLKIO / before.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc) -> None:
        for mount in reversed(self._mounted):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        self._mounted.clear()
        for device in self.devices:
            subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        self.devices.clear()
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
            self.cgroup = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
