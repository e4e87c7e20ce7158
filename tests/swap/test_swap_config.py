"""SwapConfig: one set of aio defaults (AioConfig's), DeepSpeed and `deepoffload tune` files load unchanged, and
every bad key or value is an error that names it."""

from __future__ import annotations

import json

import pytest

from deepoffload.config import AioConfig, ConfigError
from deepoffload.swap.config import SwapConfig


def test_defaults_are_aioconfigs(monkeypatch):
    for key in AioConfig.keys():
        monkeypatch.delenv(f"DEEPOFFLOAD_AIO_{key.upper()}", raising=False)
    assert SwapConfig().aio == AioConfig()
    monkeypatch.setenv("DEEPOFFLOAD_AIO_QUEUE_DEPTH", "8")
    assert SwapConfig().aio.queue_depth == 8


def test_tune_output_loads_unchanged(tmp_path):
    tuned = {
        "block_size": 4 << 20,
        "queue_depth": 64,
        "intra_op_parallelism": 2,
        "single_submit": True,
        "overlap_events": False,
        "engine": "posix",
    }
    path = tmp_path / "aio.json"
    path.write_text(json.dumps(tuned))
    config = SwapConfig.from_json(path)
    assert config.aio.to_dict() == tuned
    assert config.chunk_bytes == SwapConfig().chunk_bytes


def test_deepspeed_layout_and_aliases():
    config = SwapConfig.from_dict(
        {
            "aio": {"thread_count": 3, "block_size": 65536},
            "nvme_path": "/nvme",
            "pin_memory": False,
            "buffer_count": 5,
            "chunk_bytes": 1 << 20,
            "checksum": True,
            "keep_files": True,
        }
    )
    assert (config.aio.intra_op_parallelism, config.aio.block_size) == (3, 65536)
    assert (config.folder, config.pin, config.buffer_count, config.chunk_bytes, config.checksum, config.keep_files) == (
        "/nvme",
        False,
        5,
        1 << 20,
        True,
        True,
    )
    assert SwapConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "values, message",
    [
        ({"bogus": 1}, "unknown swap config key 'bogus'"),
        ({"aio": {"bogus": 1}}, "unknown aio config key 'bogus'"),
        ({"buffer_count": 0}, "buffer_count: must be a positive integer"),
        ({"chunk_bytes": "1M"}, "chunk_bytes: must be a positive integer"),
        ({"checksum": "yes"}, "checksum: expected true or false"),
        ({"folder": ""}, "folder: expected a path"),
        ({"queue_depth": 4, "aio": {"queue_depth": 8}}, "queue_depth: given both"),
        ({"folder": "/a", "nvme_path": "/b"}, "nvme_path: given twice"),
        ({"aio": 3}, "aio: expected a section"),
        ({"engine": "floppy"}, "engine: expected one of"),
    ],
)
def test_bad_keys_and_values_name_themselves(values, message):
    with pytest.raises(ConfigError, match=message):
        SwapConfig.from_dict(values)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        SwapConfig.from_json(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        SwapConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="expected a mapping"):
        SwapConfig.from_dict([1])
