"""``torch.distributed.checkpoint`` (DCP) storage whose bytes move through the async-IO op.

``FileSystemWriter`` and ``FileSystemReader`` are DCP's own classes with their filesystem swapped for one that opens
``DirectWriter``/``DirectReader`` streams, so planning, metadata, file names and file contents are exactly DCP's
(either side reads what the other wrote); only the IO differs: each rank's file is written through multi-buffered
aligned O_DIRECT writes and read with aligned read-ahead. Use them wherever DCP's are used::

    import torch.distributed.checkpoint as dcp
    from deepoffload.dcp import FileSystemReader, FileSystemWriter

    dcp.save(state_dict, storage_writer=FileSystemWriter("/nvme/ckpt/step100"))
    dcp.load(state_dict, storage_reader=FileSystemReader("/nvme/ckpt/step100"))

Saving again into the same folder is crash-consistent: each save's data files get names no earlier save used
(``__<rank>_<generation>_<n>.distcp``) and are written privately (``0600``); the ``.metadata`` naming them is
renamed over the old one (never removed first) and the folder fsynced, which switches readers from the whole old
checkpoint to the whole new one. Only then are the old data files removed, and the new ones given the old
checkpoint's mode (or the umask's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generator

from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .checkpoint.streams import DirectReader, DirectWriter
from .config import AioConfig
from .formats.commit import new_generation, sync_folder
from .io.owners import PRIVATE_MODE, adopt_mode

METADATA_NAME = ".metadata"  # DCP's name for the file that names every data file of a checkpoint
_DATA_FILE = re.compile(r"__(?P<rank>\d+)_(?:[0-9a-f]{8}_)?\d+\.distcp")

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
                raise ValueError(
                    f"deepoffload.dcp: cannot open {path} with mode {mode!r}; only 'wb' (a new file, "
                    f"written front to back) is supported"
                )
            # private until the save is complete; DCP fsyncs itself (sync_files)
            stream = DirectWriter(path, config=self.config, sync=False, mode=PRIVATE_MODE)
            try:
                yield stream
            except BaseException:
                stream.abort()
                _remove(path)
                raise
            try:
                stream.close()  # DCP may have closed it already; a second close does nothing
            except BaseException:
                _remove(path)
                raise
        else:
            with DirectReader(path, config=self.config) as reader:
                try:
                    yield reader
                except Exception as e:
                    if reader.error is not None and reader.error is not e:  # torch.load hides the read's error
                        raise reader.error from e
                    raise

    def rm_file(self, path: str | os.PathLike) -> None:
        """Remove ``path``; except DCP's ``.metadata``, which DCP removes just before renaming the new one over it:
        the rename replaces it atomically, and removing it first would leave no checkpoint if the writer died.
        """
        if Path(path).name.endswith(METADATA_NAME):
            return
        os.unlink(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Atomically replace ``new_path`` by ``path`` (given ``new_path``'s mode first) and fsync the folder."""
        adopt_mode(path, new_path)
        os.replace(path, new_path)
        sync_folder(Path(new_path).parent)


def _remove(path: str | os.PathLike) -> None:
    """Remove the file of a failed write: a failed save leaves no file behind."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class FileSystemWriter(_dcp_fs.FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same arguments), writing through the async-IO op; ``config`` sets the op.
    Re-saving into a folder is crash-consistent (see the module docstring).
    """

    def __init__(self, path: str | os.PathLike, *args: Any, config: AioConfig | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        if plan.storage_data is not None:  # each rank names its own files (no collectives): add a generation
            plan = dataclasses.replace(
                plan, storage_data=_dcp_fs._StoragePrefix(f"{plan.storage_data.prefix}{new_generation()}_")
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        generation = new_generation()  # one for the whole save, chosen by the coordinator
        return [
            dataclasses.replace(plan, storage_data=_dcp_fs._StoragePrefix(f"__{i}_{generation}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        folder = Path(self.path)
        global_metadata = self.use_collectives or self.rank is None
        metadata_path = folder / (METADATA_NAME if global_metadata else f"__{self.rank}{METADATA_NAME}")
        names = {result.storage_data.relative_path for group in results for result in group}
        for name in names:  # the checkpoint's mode, before its files can be reached through the metadata
            with contextlib.suppress(FileNotFoundError):  # another node's file, in a folder not shared with this one
                adopt_mode(folder / name, metadata_path)
        super().finish(metadata, results)  # writes the metadata and renames it into place (see OpFileSystem)
        for entry in os.scandir(folder):  # the data files of earlier saves (and of saves that died)
            match = _DATA_FILE.fullmatch(entry.name)
            if match and entry.name not in names and (global_metadata or int(match["rank"]) == self.rank):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


class FileSystemReader(_dcp_fs.FileSystemReader):
    """DCP's ``FileSystemReader`` (same arguments), reading through the async-IO op; ``config`` sets the op.

    Items are read in file order (DCP's reader takes them in plan order), so each file is read front to back and
    the read-ahead never fetches what is then skipped.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, config: AioConfig | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = OpFileSystem(config)
        self.path = self.fs.init_path(path)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        def position(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=position)), planner)
