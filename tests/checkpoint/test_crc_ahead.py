"""Large records' CRC-32 computed ahead on another thread (``CrcAhead``): the file is still exactly torch.save's,
for records above and below the threshold, from host memory and from save_async's snapshot."""

from __future__ import annotations

import io

import torch

import deepoffload
from deepoffload.formats.torch_zip import crc_ahead


def test_records_checksummed_ahead_give_exactly_torch_saves_bytes(scratch, monkeypatch):
    g = torch.Generator().manual_seed(0)
    obj = {
        "big": torch.randn(1 << 19, generator=g),
        "odd": torch.randn(300_001, generator=g),
        "small": torch.randn(10, generator=g),
        "view": torch.arange(1 << 20, dtype=torch.int16)[5:],
        "empty": torch.empty(0),
        "meta": {"step": 3},
    }
    used = []
    get = crc_ahead.CrcAhead.get

    def spy(self, name):
        future = get(self, name)
        used.append(future is not None)
        return future

    monkeypatch.setattr(crc_ahead.CrcAhead, "get", spy)
    expected = io.BytesIO()
    torch.save(obj, expected)
    deepoffload.save(obj, scratch / "a.pt")
    assert (scratch / "a.pt").read_bytes() == expected.getvalue()
    assert any(used) and not all(used), "both paths ran: ahead for large records, staged for small ones"
    deepoffload.save_async(obj, scratch / "b.pt").result()
    assert (scratch / "b.pt").read_bytes() == expected.getvalue()
    assert deepoffload.load(scratch / "b.pt", checksum=True).keys() == obj.keys()
