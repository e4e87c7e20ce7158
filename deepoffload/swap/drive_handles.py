"""One ``AsyncIOHandle`` per drive of a storage layout: each drive its own queue and IO threads.

A swapper over several drives (the ``drives`` layout) submits each file's transfers to the handle of the drive the
file lies on, so a slow or stalled drive holds back only its own queue, never the others' submissions.
"""

from __future__ import annotations

from ..config import AioConfig
from ..io.handle import AsyncIOHandle
from .layouts.base import StorageLayout


class DriveHandles:
    """The IO handles of a layout's drives (``layout.drives`` of them, made with the same settings).

    Args:
        layout: The storage layout (``drives`` and ``drive(path)``).
        config: The async-IO settings of every handle.

    Attributes:
        handles: One handle per drive, in the layout's drive order.
    """

    def __init__(self, layout: StorageLayout, config: AioConfig) -> None:
        self.layout = layout
        self.handles = [AsyncIOHandle(config) for _ in range(layout.drives)]

    def of(self, path: str) -> AsyncIOHandle:
        """The handle of the drive holding ``path``.

        Args:
            path: A file the layout named.

        Returns:
            That drive's handle.
        """
        return self.handles[self.layout.drive(path)] if len(self.handles) > 1 else self.handles[0]

    def close(self) -> None:
        """Close every handle (each waits for its own transfers first)."""
        for handle in self.handles:
            handle.close()
