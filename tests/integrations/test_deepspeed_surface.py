"""The DeepSpeed surface against DeepSpeed 0.19.8's own binding: every method, keyword name and default read from
its ``py_ds_aio.cpp`` exists here with the same name, order and default; then each call as DeepSpeed's code makes it
returns what DeepSpeed returns, except the documented differences (errors raise instead of returning -1 or
aborting)."""

from __future__ import annotations

import errno
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from deepoffload.io.compat import aio_handle

MODULE_FUNCTIONS = ["aio_read", "aio_write", "deepspeed_memcpy"]


def deepspeed_binding() -> str:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed (pip install deepoffload[deepspeed]): its binding is the reference")
    path = Path(spec.origin).parent / "ops/csrc/aio/py_lib/py_ds_aio.cpp"
    if not path.exists():
        pytest.skip(f"deepspeed's sources are not installed ({path} is missing)")
    return path.read_text()


def parse_binding(text: str) -> tuple[dict[str, list[list[tuple[str, str | None]]]], list[str]]:
    """({method: [overload arguments [(name, default or None)]]}, module functions) from DeepSpeed's binding."""
    body = text[text.index("PYBIND11_MODULE") :]
    functions = re.findall(r'm\.def\("(\w+)"', body)
    methods: dict[str, list[list[tuple[str, str | None]]]] = {}
    for chunk in body.split(".def(")[1:]:
        name = re.match(r'\s*"(\w+)"', chunk)
        if name is None or name.group(1) in functions:
            continue
        args = [(a, d.strip() if d else None) for a, d in re.findall(r'"(\w+)"_a(?:\s*=\s*([^,)\n]+))?', chunk)]
        methods.setdefault(name.group(1), []).append(args)
    init = re.search(r"py::init<[^>]*>\(\),(.*?)\)\s*\n", body, re.S)
    methods["__init__"] = [[(a, d.strip()) for a, d in re.findall(r'"(\w+)"_a\s*=\s*([^,)\n]+)', init.group(1))]]
    return methods, functions


def cpp_default(text: str):
    """A C++ default from the binding: false, true, an int, or a product of ints."""
    if text in ("false", "true"):
        return text == "true"
    value = 1
    for factor in text.split("*"):
        value *= int(factor)
    return value


def test_every_method_keyword_and_default_of_deepspeeds_binding():
    methods, functions = parse_binding(deepspeed_binding())
    assert len(methods) >= 19 and set(functions) == set(MODULE_FUNCTIONS)
    from deepoffload.io import compat

    for name in functions:
        assert callable(getattr(compat, name)), name
    for name, overloads in methods.items():
        ours = inspect.signature(getattr(aio_handle, name)).parameters
        positional = [p for p in list(ours)[1:] if ours[p].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        for args in overloads:
            names = [a for a, _ in args]
            if "fd" in names:  # the descriptor overload: fd is the second positional argument or a keyword
                assert "fd" in ours and ours["fd"].kind == inspect.Parameter.KEYWORD_ONLY, name
                names = [n if n != "fd" else "filename" for n in names]
            if "async" in names:  # a Python keyword: positional, or "async" through **kwargs
                assert any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.values()), name
                names = [n if n != "async" else "async_op" for n in names]
            assert positional[: len(names)] == names, (name, positional, names)
            for arg, default in args:
                arg = {"async": "async_op", "fd": "filename"}.get(arg, arg)
                if default is not None:
                    assert ours[arg].default == cpp_default(default), (name, arg)


def test_constructor_defaults_are_deepspeeds():
    h = aio_handle()
    assert (
        h.get_block_size(),
        h.get_queue_depth(),
        h.get_single_submit(),
        h.get_overlap_events(),
        h.get_intra_op_parallelism(),
    ) == (1 << 20, 128, False, False, 1)


@pytest.mark.parametrize("threads", [1, 3])
def test_alignment_is_512_times_parallelism(threads):
    assert aio_handle(1 << 20, 8, False, True, threads).get_alignment() == 512 * threads


@pytest.mark.parametrize("block_size", [512, 1024, 4095, 4097])
def test_small_and_odd_block_sizes_are_accepted(scratch, block_size):
    h = aio_handle(block_size, 4, False, False, 2)
    assert h.get_block_size() == block_size
    data = torch.randint(0, 256, (50_001,), dtype=torch.uint8)
    path = str(scratch / "small-blocks")
    assert h.sync_pwrite(data, path) == 1
    out = torch.empty_like(data)
    assert h.sync_pread(out, path) == 1 and torch.equal(out, data)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="block_size"):
            aio_handle(bad)


def test_calls_as_deepspeed_code_makes_them(scratch):
    h = aio_handle(block_size=1048576, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=3)
    buf = h.new_cpu_locked_tensor(1_000_001, torch.empty(0, dtype=torch.float16))
    assert buf.dtype == torch.float16 and buf.numel() == 1_000_001 and h.is_pinned(buf)
    buf.copy_(torch.randn(1_000_001))
    path = str(scratch / "ds")
    assert h.sync_pwrite(buf, path) == 1
    assert h.write(buf, path, True) == 1
    assert h.write(buffer=buf, filename=path, validate=True, file_offset=0) == 1
    out = torch.empty_like(buf)
    assert h.async_pread(out, path) == 0
    assert h.wait() == 1 and torch.equal(out, buf)
    assert h.pread(out, path, False, True, 0) == 0 and h.pwrite(buf, path + "2", False, True, 2) == 0
    assert h.wait() == 2
    assert h.wait() == 0
    assert h.pread(buffer=out, filename=path, validate=False, **{"async": False}) == 1
    assert h.pwrite(buf, path, False, **{"async": True}, file_offset=0) == 0 and h.wait() == 1
    assert h.read(out, path, False) == 1 and torch.equal(out, buf)
    with pytest.raises(TypeError, match="async"):
        h.pread(out, path, False)
    with pytest.raises(TypeError, match="unexpected"):
        h.pwrite(buf, path, False, True, asynch=True)


def test_synchronous_call_also_waits_for_pending_asynchronous_ones(scratch):
    # DeepSpeed's synchronous calls wait for every pending operation and return how many completed (its
    # _wait_locked), so code written for it uses an asynchronous read's buffer after a later synchronous call and
    # never calls wait() then (DeepSpeed would abort). Returning after the synchronous one alone left that buffer
    # being filled (and a reused write buffer being written) while the caller went on.
    h = aio_handle()
    data = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
    small = torch.arange(4096, dtype=torch.int32)
    h.sync_pwrite(data, str(scratch / "big"))
    out = torch.zeros_like(data)
    assert h.async_pread(out, str(scratch / "big")) == 0
    assert h.async_pwrite(data[: 1 << 20].clone(), str(scratch / "piece")) == 0
    assert h.sync_pwrite(small, str(scratch / "small")) == 3
    assert torch.equal(out, data) and (scratch / "piece").stat().st_size == 1 << 20
    assert h.wait() == 0
    assert h.async_pread(out, str(scratch / "big")) == 0
    assert h.read(torch.empty_like(small), str(scratch / "small"), True) == 2 and torch.equal(out, data)
    h.async_pread(torch.empty(100, dtype=torch.uint8), str(scratch / "small"), 1 << 20)  # past the end
    with pytest.raises(OSError) as info:
        h.sync_pread(torch.empty_like(small), str(scratch / "small"))
    assert info.value.errno == errno.ENODATA and h.wait() == 0  # the failed one is raised, none is left pending


def test_descriptor_overloads(scratch):
    h = aio_handle(1 << 20, 8, False, True, 2)
    data = torch.arange(300_000, dtype=torch.int32)
    path = scratch / "fd"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert h.async_pwrite(data[:150_000].clone(), fd, 0) == 0  # positional
        assert h.async_pwrite(buffer=data[150_000:].clone(), fd=fd, file_offset=600_000) == 0  # keywords
        assert h.wait() == 2
    finally:
        os.close(fd)
    out = torch.empty_like(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert h.sync_pread(out, fd=fd) == 1
    finally:
        os.close(fd)
    assert torch.equal(out, data)
    with pytest.raises(TypeError, match="either filename or fd"):
        h.async_pwrite(data, str(path), fd=3)
    # Every other read/write call takes a descriptor too (DeepSpeed: only async_pwrite), by keyword or position.
    writes = [
        lambda b, fd: h.sync_pwrite(b, fd=fd),
        lambda b, fd: h.write(b, fd=fd, validate=False),
        lambda b, fd: h.pwrite(b, fd=fd, validate=False, async_op=False),
        lambda b, fd: h.sync_pwrite(b, fd, 0),
    ]
    reads = [
        lambda b, fd: h.sync_pread(b, fd=fd),
        lambda b, fd: h.read(b, fd=fd, validate=False),
        lambda b, fd: h.pread(b, fd=fd, validate=False, async_op=False),
        lambda b, fd: h.async_pread(b, fd, 0) + h.wait(),
    ]
    for i, (write, read) in enumerate(zip(writes, reads)):
        data = torch.full((5000,), i, dtype=torch.int32)
        fd = os.open(scratch / f"fd{i}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            assert write(data, fd) == 1
            out = torch.empty_like(data)
            assert read(out, fd) == 1 and torch.equal(out, data)
        finally:
            os.close(fd)


def test_example_tenosr_keyword_and_free_semantics():
    h = aio_handle()
    t = h.new_cpu_locked_tensor(num_elem=4096, example_tenosr=torch.empty(0, dtype=torch.float32))
    t2 = h.new_cpu_locked_tensor(10, example_tensor=torch.empty(0, dtype=torch.int8))
    assert t.dtype == torch.float32 and t2.dtype == torch.int8
    assert h.is_pinned(t) and h.is_pinned(t[100:200])
    assert h.free_cpu_locked_tensor(t) is True
    assert h.is_pinned(t) is False
    assert h.free_cpu_locked_tensor(t) is False
    t.fill_(1.5)  # the memory stays valid while the tensor lives (DeepSpeed frees it at once)
    assert float(t.sum()) == 1.5 * 4096
    assert h.free_cpu_locked_tensor(torch.empty(10)) is False
    assert h.is_pinned(torch.empty(10)) is False


def test_pieces_never_truncate(scratch):
    """4 MiB at offset 4 MiB, then 4 MiB at offset 0 (DeepSpeed keeps 8 MiB), and a shorter write at offset 0 over
    a longer file keeps the tail (no O_TRUNC)."""
    n = 4 << 20
    h = aio_handle()
    path = str(scratch / "pieces")
    assert h.sync_pwrite(torch.full((n,), 2, dtype=torch.uint8), path, n) == 1
    assert h.sync_pwrite(torch.full((n,), 1, dtype=torch.uint8), path, 0) == 1
    assert Path(path).read_bytes() == b"\x01" * n + b"\x02" * n
    assert h.sync_pwrite(torch.full((10,), 3, dtype=torch.uint8), path) == 1
    assert os.path.getsize(path) == 2 * n


def test_module_level_functions(scratch, capfd):
    from deepoffload.op_builder import AsyncIOBuilder

    module = AsyncIOBuilder().load()
    data = torch.randn(100_003)
    path = str(scratch / "module")
    capfd.readouterr()
    assert module.aio_write(data, path, 1 << 20, 8, False, True, True) == 0
    out = torch.empty_like(data)
    assert module.aio_read(out, path, 1 << 20, 8, False, True, True) == 0 and torch.equal(out, data)
    assert capfd.readouterr() == ("", "")  # DeepSpeed's print their timings
    shorts = torch.arange(-50, 50, dtype=torch.int16)
    copied = torch.empty_like(shorts)
    assert module.deepspeed_memcpy(copied, shorts) == 0 and torch.equal(copied, shorts)
    with pytest.raises(ValueError, match="buffer of the file's size"):
        module.aio_read(torch.empty(10), path, 1 << 20, 8, False, True, False)
    dest = torch.empty(100_003)
    assert module.deepspeed_memcpy(dest, data) == 0 and torch.equal(dest, data)
    with pytest.raises(ValueError, match="must match"):
        module.deepspeed_memcpy(torch.empty(3), data)


def test_errors_raise_where_deepspeed_returns_minus_one(scratch):
    h = aio_handle()
    with pytest.raises(FileNotFoundError):
        h.sync_pread(torch.empty(10), str(scratch / "missing"))
    (scratch / "short").write_bytes(b"x" * 10)
    with pytest.raises(OSError) as info:
        h.sync_pread(torch.empty(100, dtype=torch.uint8), str(scratch / "short"))
    assert info.value.errno == errno.ENODATA  # reading past the end: DeepSpeed aborts the process
    assert "read" in str(info.value) and "short" in str(info.value) and "offset" in str(info.value)
    h.async_pread(torch.empty(100, dtype=torch.uint8), str(scratch / "short"))
    with pytest.raises(OSError):
        h.wait()
    assert h.wait() == 0


def test_tensors_it_cannot_transfer_exactly_are_refused(scratch):
    h = aio_handle()
    path = str(scratch / "refused")
    cases = [
        (torch.ones(4, 4).t(), "contiguous"),
        (torch.eye(3).to_sparse(), "sparse"),
        (torch.ones(4, dtype=torch.complex64).conj(), "resolve_conj"),
    ]
    for tensor, fix in cases:
        with pytest.raises(ValueError, match=fix):
            h.sync_pwrite(tensor, path)


def test_enable_without_deepspeed_says_how_to_install(monkeypatch):
    from deepoffload.integrations import deepspeed as integration

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install deepoffload\[deepspeed\]"):
        integration.enable()
    assert not integration.enabled()
