"""Arguments a caller may reasonably pass (bytes and path-like paths, an infinite timeout, a shape from a config
string) and ones that must be refused with the right message (a NUL byte in a path, a typo in an environment
variable, a quantized tensor)."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from deepoffload import AioConfig, aligned_empty
from deepoffload.config import ConfigError


class BytesPath:
    def __init__(self, path: bytes):
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("name", ["model\x00.bak", b"model\x00.bak"])
def test_nul_byte_in_path_is_refused_like_open(handle, scratch, name):
    with pytest.raises(ValueError, match="null byte"):
        open(os.path.join(os.fsencode(scratch) if isinstance(name, bytes) else scratch, name), "wb")
    full = os.path.join(os.fsencode(scratch) if isinstance(name, bytes) else str(scratch), name)
    t = torch.arange(10)
    with pytest.raises(ValueError, match="null byte"):
        handle.write(t, full)
    with pytest.raises(ValueError, match="null byte"):
        handle.read(t, full)
    assert os.listdir(scratch) == []  # nothing named "model" was created


def test_bytes_and_pathlike_paths_work_like_open(handle, scratch):
    t = torch.arange(100_000, dtype=torch.float64)
    for path in (
        os.fsencode(scratch / "a.bin"),
        BytesPath(os.fsencode(scratch / "b.bin")),
        scratch / "c.bin",
        os.fsencode(scratch) + b"/\xff\xfe-not-utf8.bin",
    ):
        assert handle.write(t, path) == t.nbytes
        back = torch.empty_like(t)
        assert handle.read(back, path, validate=True) == t.nbytes
        assert torch.equal(back, t)
        with open(path, "rb") as f:
            assert len(f.read()) == t.nbytes
    missing = os.fsencode(scratch) + b"/\xff-missing.bin"
    with pytest.raises(FileNotFoundError) as e:
        handle.read(back, missing)
    assert e.value.filename == os.fsdecode(missing)


def test_wait_timeouts(handle, scratch):
    t = torch.arange(1 << 16)
    for timeout in (float("inf"), 1e300, 10**30, 5, 0.5):
        assert handle.write_async(t, scratch / "t.bin").wait(timeout=timeout) == t.nbytes
    request = handle.read_async(torch.empty_like(t), scratch / "t.bin")
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            request.wait(timeout=bad)
    with pytest.raises(TypeError, match="timeout"):
        request.wait(timeout="1")
    while True:  # timeout=0 polls
        try:
            assert request.wait(timeout=0) == t.nbytes
            break
        except TimeoutError:
            pass
    assert request.wait(timeout=math.inf) == t.nbytes


def test_aligned_empty_shape_types():
    for bad in ("10", b"10", 10.0, ["2", 3], True, None):
        with pytest.raises(TypeError, match="aligned_empty"):
            aligned_empty(bad)
    assert aligned_empty(torch.Size([2, 3]), torch.float32).shape == (2, 3)
    assert aligned_empty((2, torch.tensor(3)), torch.float32).shape == (2, 3)
    assert aligned_empty(7).shape == (7,)


def test_unknown_environment_variable_is_an_error_naming_the_valid_ones():
    with pytest.raises(ConfigError, match="DEEPOFFLOAD_AIO_ENGIN.*DEEPOFFLOAD_AIO_ENGINE"):
        AioConfig.from_env({"DEEPOFFLOAD_AIO_ENGIN": "posix"})
    with pytest.raises(ConfigError, match="DEEPOFFLOAD_AIO_QUEUEDEPTH"):
        AioConfig.from_env({"DEEPOFFLOAD_AIO_QUEUEDEPTH": "8"})
    assert AioConfig.from_env({"DEEPOFFLOAD_AIOX": "1", "OTHER": "2"}) == AioConfig()  # not our prefix


def test_thread_count_alias_in_the_environment():
    assert AioConfig.from_env({"DEEPOFFLOAD_AIO_THREAD_COUNT": "3"}).intra_op_parallelism == 3
    assert AioConfig.from_dict({"thread_count": 3}, base=AioConfig()).intra_op_parallelism == 3
    with pytest.raises(ConfigError, match="twice"):
        AioConfig.from_env({"DEEPOFFLOAD_AIO_THREAD_COUNT": "3", "DEEPOFFLOAD_AIO_INTRA_OP_PARALLELISM": "2"})


def test_quantized_tensor_is_refused_as_quantized(handle, scratch):
    q = torch.quantize_per_tensor(torch.randn(100), 0.1, 0, torch.qint8)
    for op in (handle.write, handle.read):
        with pytest.raises(ValueError, match="quantized") as e:
            op(q, scratch / "q.bin")
        assert "sparse" not in str(e.value)
        assert "int_repr" in str(e.value)
    with pytest.raises(ValueError, match="sparse"):
        handle.write(torch.eye(3).to_sparse(), scratch / "s.bin")


def _followed(message: str, tensor: torch.Tensor, read) -> None:
    """Run the read the message advises: ``buf = ...`` from it, the read into buf, then what it says to do."""
    found = re.search(r"read into a new tensor instead \(buf = (.+?); .*\), wait, then (tensor\.copy_\(buf\))", message)
    assert found, message
    scope = {"torch": torch, "tensor": tensor}
    exec(f"buf = {found.group(1)}", scope)
    read(scope["buf"])
    eval(found.group(2), scope)


@pytest.mark.parametrize("view", ["transposed", "sliced", "conjugate"])
def test_a_read_into_a_tensor_that_cannot_take_bytes_advises_a_read_that_fills_it(handle, scratch, view):
    """A read into a non-contiguous or lazy conjugate view is refused; the advice is not "pass tensor.contiguous()"
    (that copy would get the bytes and the caller's tensor none) but a read into a new tensor copied in, which gives
    the tensor the values written."""
    source = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    if view == "conjugate":
        source = torch.complex(source, -source)
    base = torch.zeros(source.t().shape if view == "transposed" else (4, 12), dtype=source.dtype)
    target = {"transposed": lambda: base.t(), "sliced": lambda: base[:, ::2], "conjugate": lambda: base[:, :6]}[view]()
    written = source if view != "conjugate" else source.conj().resolve_conj()
    handle.write(written.contiguous(), scratch / "t.bin")  # the write advice: a contiguous copy
    if view == "conjugate":
        target = target.contiguous().conj()  # (a lazy view: its memory holds the conjugates)
    with pytest.raises(ValueError, match="read into a new tensor instead") as refused:
        handle.read(target, scratch / "t.bin")
    assert "pass tensor.contiguous()" not in str(refused.value)
    _followed(str(refused.value), target, lambda buf: handle.read(buf, scratch / "t.bin"))
    assert torch.equal(target, written)


def test_a_write_of_a_non_contiguous_tensor_advises_a_contiguous_copy(handle, scratch):
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    with pytest.raises(ValueError, match=r"pass tensor\.contiguous\(\) \(a copy\) instead"):
        handle.write(tensor, scratch / "t.bin")
    handle.write(tensor.contiguous(), scratch / "t.bin")
    back = torch.empty(tensor.shape)
    handle.read(back, scratch / "t.bin")
    assert torch.equal(back, tensor)


def test_environment_variable_typo_fails_the_first_handle(monkeypatch, aio):
    from deepoffload import AsyncIOHandle

    monkeypatch.setenv("DEEPOFFLOAD_AIO_BLOCKSIZE", "4096")
    with pytest.raises(ConfigError, match="DEEPOFFLOAD_AIO_BLOCK_SIZE"):
        AsyncIOHandle()
