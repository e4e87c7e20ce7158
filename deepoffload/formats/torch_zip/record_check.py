"""Checking a zip-format ``torch.save`` file's storages against its records before their bytes are used.

``torch.load`` reads each storage as its own record and refuses one whose size differs from what the pickle claims;
a storage sliced from one buffer holding the whole file (``deepoffload.load``) would otherwise run on into the zip
metadata and the next record's bytes. ``CheckedStorage`` stands in for that buffer and allows only slices that are
exactly one record's bytes.
"""

from __future__ import annotations

import torch

from ...errors import CheckpointError


def data_records(archive) -> dict[int, tuple[str, int]]:
    """Map every ``data/<key>`` record of ``archive`` by its offset.

    Args:
        archive: A ``torch._C.PyTorchFileReader``.

    Returns:
        Byte offset in the file -> (record name, size in bytes).
    """
    records = {}
    for name in archive.get_all_records():
        if name.startswith("data/"):
            records[archive.get_record_offset(name)] = (name, archive.get_record_size(name))
    return records


class CheckedStorage:
    """The whole file's bytes as torch's ``_load`` slices them into storages (its ``overall_storage``).

    A slice must start where a data record starts and span exactly that record's bytes, else ``CheckpointError``
    naming ``path``, the record and both sizes.

    Args:
        storage: The whole file's bytes.
        records: Byte offset -> (record name, size), from ``data_records``.
        path: The file, named in errors.
    """

    def __init__(self, storage: torch.UntypedStorage, records: dict[int, tuple[str, int]], path: str) -> None:
        self._storage, self._records, self._path = storage, records, path

    def __getitem__(self, index: slice) -> torch.UntypedStorage:
        start, stop = index.start, index.stop
        record = self._records.get(start)
        if record is None:
            raise CheckpointError(
                f"cannot load {self._path}: a storage is said to start at byte {start}, where no "
                f"data record starts (the file is damaged or was crafted)"
            )
        name, size = record
        if stop - start != size:
            raise CheckpointError(
                f"cannot load {self._path}: record {name} holds {size} bytes but the pickle "
                f"claims {stop - start} for its storage (as torch.load, refused: the file is "
                f"damaged or was crafted)"
            )
        return self._storage[index]
