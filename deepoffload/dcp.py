"""``torch.distributed.checkpoint`` (DCP) storage whose bytes move through the async-IO op.

``FileSystemWriter`` and ``FileSystemReader`` are DCP's own classes with their filesystem swapped for one that opens
``DirectWriter``/``DirectReader`` streams, so planning, metadata, file names and file contents are exactly DCP's
(either side reads what the other wrote); only the IO differs: each rank's file is written through multi-buffered
aligned O_DIRECT writes and read with aligned read-ahead. Use them wherever DCP's are used::

    import torch.distributed.checkpoint as dcp
    from deepoffload.dcp import FileSystemReader, FileSystemWriter

    dcp.save(state_dict, storage_writer=FileSystemWriter("/nvme/ckpt/step100"))
    dcp.load(state_dict, storage_reader=FileSystemReader("/nvme/ckpt/step100"))
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from typing import Any, Generator

from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .checkpoint.streams import DirectReader, DirectWriter
from .config import AioConfig

__all__ = ["FileSystemReader", "FileSystemWriter", "OpFileSystem"]


class OpFileSystem(_dcp_fs.FileSystem):
    """DCP's local ``FileSystem`` with streams through the async-IO op (``config``: its settings)."""

    def __init__(self, config: AioConfig | None = None) -> None:
        super().__init__()
        self.config = config

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" in mode or "a" in mode or "+" in mode:
            if mode not in ("wb", "w+b", "bw"):
                raise ValueError(f"deepoffload.dcp: cannot open {path} with mode {mode!r}; only 'wb' (a new file, "
                                 f"written front to back) is supported")
            stream = DirectWriter(path, config=self.config, sync=False)  # DCP fsyncs itself (sync_files)
            try:
                yield stream
            except BaseException:
                stream.abort()
                raise
            stream.close()  # DCP may have closed it already; a second close does nothing
        else:
            with DirectReader(path, config=self.config) as stream:
                try:
                    yield stream
                except Exception as e:
                    if stream.error is not None and stream.error is not e:  # torch.load hides the read's error
                        raise stream.error from e
                    raise


class FileSystemWriter(_dcp_fs.FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same arguments), writing through the async-IO op; ``config`` sets the op."""

    def __init__(self, path: str | os.PathLike, *args: Any, config: AioConfig | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)


class FileSystemReader(_dcp_fs.FileSystemReader):
    """DCP's ``FileSystemReader`` (same arguments), reading through the async-IO op; ``config`` sets the op.

    Items are read in file order (DCP's reader takes them in plan order), so each file is read front to back and
    the read-ahead never fetches what is then skipped."""

    def __init__(self, path: str | os.PathLike, *args: Any, config: AioConfig | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        def position(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=position)), planner)
