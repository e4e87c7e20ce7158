"""The IO engine registry: a toy engine written in this file alone, registered through ``deepoffload.io.engines``
only, moves bytes end to end (the handle, a ``TensorSwapper``, the command line's choices, the report); the
built-in engines are the native op's, and every list of engines is read from the registry."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from deepoffload import AioConfig, AsyncIOHandle, ConfigError, SwapConfig, TensorSwapper
from deepoffload.io import engines


class ToyEngine(engines.PythonEngine):
    """os.pread/os.pwrite, counting the bytes it moves (so the test knows the bytes went through it)."""

    name = "toy"
    description = "a test's engine: os.pread/os.pwrite on Python threads"

    def __init__(self) -> None:
        self.moved = {"read": 0, "write": 0}
        self._lock = threading.Lock()

    def transfer(self, write: bool, fd: int, view: memoryview, offset: int) -> int:
        moved = os.pwrite(fd, view, offset) if write else os.preadv(fd, [view], offset)
        with self._lock:
            self.moved["write" if write else "read"] += moved
        return moved


@pytest.fixture
def toy():
    engine = engines.register(ToyEngine())
    try:
        yield engine
    finally:
        engines.unregister("toy")


def test_a_toy_engine_moves_bytes_through_the_handle(toy, scratch):
    data = torch.randint(0, 256, (3 * 65536 + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    back = torch.empty_like(data)
    path = scratch / "toy.bin"
    with AsyncIOHandle(engine="toy", block_size=65536, intra_op_parallelism=2) as handle:
        assert handle.engine == "toy"
        assert handle.write(data, path) == data.numel()
        assert path.read_bytes() == data.numpy().tobytes()
        assert handle.read(back, path) == data.numel()
        request = handle.read_async(back[:100], path, offset=data.numel() - 100)
        assert request.wait() == 100
    assert torch.equal(back[:100], data[-100:]) and torch.equal(back[100:], data[100:])
    assert toy.moved == {"write": data.numel(), "read": data.numel() + 100}


def test_a_toy_engine_reports_errors_as_the_native_ones_do(toy, scratch):
    path = scratch / "short.bin"
    path.write_bytes(b"x" * 10)
    with AsyncIOHandle(engine="toy") as handle:
        with pytest.raises(OSError) as info:
            handle.read(torch.empty(100, dtype=torch.uint8), path)  # past the end of the file
        assert info.value.errno == errno.ENODATA and "read at offset 10" in str(info.value)
        with pytest.raises(FileNotFoundError):
            handle.read(torch.empty(1, dtype=torch.uint8), scratch / "missing.bin")
        handle.write(torch.ones(4, dtype=torch.uint8), path)  # from offset 0: the file ends where the write ends
        assert path.read_bytes() == b"\x01" * 4
        fd = os.open(path, os.O_RDWR)
        try:  # a caller's descriptor: the transfer uses its own copy, and the caller's stays open
            handle.write(torch.full((3,), 2, dtype=torch.uint8), fd, offset=4)
            back = torch.empty(7, dtype=torch.uint8)
            handle.read(back, fd)
            os.fstat(fd)
        finally:
            os.close(fd)
        assert back.tolist() == [1] * 4 + [2] * 3


def test_a_toy_engine_serves_a_tensor_swapper(toy, scratch):
    config = SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, pin=False, aio=AioConfig(engine="toy"))
    tensors = {"weight": torch.randn(64, 64), "bias": torch.arange(64, dtype=torch.float32)}
    swapper = TensorSwapper(config)
    try:
        swapper.swap_out({"layer0": tensors}).wait()
        read = swapper.swap_in(["layer0"])
        back = read.wait()["layer0"]
        assert all(torch.equal(back[k], tensors[k]) for k in tensors)
        read.release()
    finally:
        swapper.close()
    assert toy.moved["write"] > 0 and toy.moved["read"] > 0


def test_every_list_of_engines_includes_a_registered_one_and_drops_it_when_unregistered(toy):
    from deepoffload.cli.main import build_parser
    from deepoffload.diagnostics import engine_rows

    assert engines.choices()[-1] == "toy" and SwapConfig(aio=AioConfig(engine="toy")).aio.engine == "toy"
    assert build_parser().parse_args(["bench", "--path", "/tmp", "--engine", "toy"]).engine == "toy"
    row = engine_rows([])[-1]
    assert (row["name"], row["state"], row["description"]) == ("toy", "ok", ToyEngine.description)
    engines.unregister("toy")
    try:
        with pytest.raises(ConfigError, match="engine: expected one of auto, io_uring"):
            SwapConfig(aio=AioConfig(engine="toy"))
        with pytest.raises(ConfigError, match="engine: expected one of auto, io_uring"):
            AsyncIOHandle(engine="toy")
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--path", "/tmp", "--engine", "toy"])
    finally:
        engines.register(toy)


def test_the_registry_refuses_a_second_engine_of_a_name_and_what_is_not_an_engine(toy):
    with pytest.raises(ValueError, match="registered already"):
        engines.register(ToyEngine())
    with pytest.raises(ValueError, match="other than 'auto'"):
        engines.register(type("Auto", (ToyEngine,), {"name": "auto"})())
    with pytest.raises(TypeError, match="is not an Engine"):
        engines.register(object())  # type: ignore[arg-type]


def test_the_native_engines_are_the_build_table_s_in_its_order_and_share_its_flags(aio):
    from deepoffload.op_builder.async_io import ENGINE_NAMES

    assert tuple(e.name for e in engines.engines() if e.native) == ENGINE_NAMES
    assert (engines.TRUNCATE, engines.FSYNC) == (aio.TRUNCATE, aio.FSYNC)
    assert set(aio.engines()) <= set(engines.names())


def test_auto_picks_the_first_usable_native_engine(aio):
    usable = [name for name, (ok, _) in engines.engine_status().items() if ok]
    assert engines.resolve_engine("auto").name == usable[0] == aio.engines()[0]
