"""The swapper's two seams, each extended from this file alone, through its registry only: a toy storage layout
(every group in a sub-folder of its own, the pack file under another name) and a toy byte codec (zlib). Both round-trip
tensors bit for bit through a ``TensorSwapper`` (the layout through an ``OffloadedOptimizer`` too), the files lie where
the toy layout says, and the bytes on disk are the encoded ones."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig, TensorSwapper, offload_parameters
from deepoffload.errors import ChecksumError, ConfigError, UnsupportedError
from deepoffload.swap.codecs import ByteCodec, codec_names, register_codec, unregister_codec
from deepoffload.swap.folder_checks import check_run_folder
from deepoffload.swap.folders import create_run_folder, keep_run_folder, remove_run_folder
from deepoffload.swap.layouts import StorageLayout, layout_names, register_layout, unregister_layout
from deepoffload.swap.pool import round_up


class SubFolders(StorageLayout):
    """Each group's file is ``<run folder>/<group>/data.bin``; a packed swapper's is ``<run folder>/packed/all.bin``."""

    def __init__(self, config, rank=None):
        self.folder = create_run_folder(config.folder, rank, config.trust_folder_owner)
        self.kept = config.keep_files
        if self.kept:
            keep_run_folder(self.folder)

    def _in(self, sub: str, name: str) -> str:
        os.makedirs(os.path.join(self.folder, sub), mode=0o700, exist_ok=True)
        return os.path.join(self.folder, sub, name)

    def group_file(self, group):
        return self._in(group, "data.bin")

    def pack_file(self):
        return self._in("packed", "all.bin")

    def remove_file(self, path):
        super().remove_file(path)
        os.rmdir(os.path.dirname(path))

    def check(self):
        check_run_folder(self.folder)

    def keep(self):
        keep_run_folder(self.folder)
        self.kept = True

    def close(self):
        if not self.kept:
            remove_run_folder(self.folder)


class Zlib(ByteCodec):
    """zlib at level 6: lossless, a stored length that depends on the bytes."""

    calls = {"encode": 0, "decode": 0}

    def max_stored_bytes(self, nbytes):
        return nbytes + (nbytes >> 12) + 64  # zlib's worst case is nbytes + 5 per 16 KiB block + 6

    def encode(self, source, out):
        Zlib.calls["encode"] += 1
        data = zlib.compress(source.numpy().tobytes(), 6)
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def decode(self, stored, out):
        Zlib.calls["decode"] += 1
        data = zlib.decompress(stored.numpy().tobytes())
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)


class TwoPacks(SubFolders):
    """As ``SubFolders``, with a packed swapper's extents spread over two pack files (as over two drives)."""

    def pack_files(self):
        return [self._in("packed", "first.bin"), self._in("packed", "second.bin")]


@pytest.fixture(autouse=True)
def toys():
    register_layout("test-subfolders")(SubFolders)
    register_layout("test-two-packs")(TwoPacks)
    register_codec("test-zlib")(Zlib)
    yield
    unregister_layout("test-subfolders")
    unregister_layout("test-two-packs")
    unregister_codec("test-zlib")


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(64, 33, generator=g),
        "half": torch.randn(100, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (17,), generator=g),
        "zeros": torch.zeros(5000),  # compresses well
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(8, 6, generator=g).t(),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bit for bit, NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_the_registries_list_the_built_ins_and_the_toys():
    assert layout_names()[0] == "folder" and "test-subfolders" in layout_names()
    assert codec_names()[0] == "none" and "test-zlib" in codec_names()
    with pytest.raises(ValueError, match="registered already"):
        register_layout("folder")(SubFolders)


@pytest.mark.parametrize("layout", layout_names())
@pytest.mark.parametrize("codec", codec_names())
def test_every_registered_layout_and_codec_round_trips(scratch, layout, codec):
    """The built-ins, from the registries (a layout or codec registered by the package joins this test)."""
    written = {"a": tensors(3), "b": {"w": torch.randn(300)}}
    with TensorSwapper(SwapConfig(folder=str(scratch), layout=layout, codec=codec, pin=False)) as swapper:
        swapper.swap_out(written).wait()
        assert {r.codec for g in written for r in swapper.records(g).values()} == {codec}
        read = swapper.swap_in(list(written))
        back = read.wait()
        assert all(same(back[g][k], v) for g, values in written.items() for k, v in values.items())
        read.release()


def test_an_unknown_layout_or_codec_is_refused_naming_the_registered_ones(scratch):
    with pytest.raises(ConfigError, match="layout: no storage layout named 'nope'; registered: folder"):
        SwapConfig(folder=str(scratch), layout="nope", pin=False)
    with pytest.raises(ConfigError, match="codec: no byte codec named 'nope'; registered: none"):
        SwapConfig.from_dict({"nvme_path": str(scratch), "codec": "nope"})
    with pytest.raises(ConfigError, match="layout"):
        SwapConfig(layout="")
    assert os.listdir(scratch) == []  # refused before any folder was made
    config = SwapConfig(folder=str(scratch), layout="test-subfolders", codec="test-zlib")  # this file's toys
    assert SwapConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("packed", [False, True])
def test_a_toy_layout_places_the_files_and_round_trips(scratch, packed):
    swapper = TensorSwapper(SwapConfig(folder=str(scratch), layout="test-subfolders", pin=False), packed=packed)
    run = swapper.folder
    assert os.path.dirname(run) == str(scratch) and swapper.layout.name == "test-subfolders"
    written = {"a": tensors(0), "b": tensors(1)}
    swapper.swap_out(written).wait()
    if packed:
        assert sorted(os.listdir(run)) == [".deepoffload-run", "packed"]
        assert os.listdir(os.path.join(run, "packed")) == ["all.bin"]
    else:
        assert sorted(os.listdir(run)) == [".deepoffload-run", "a", "b"]
        for group in "ab":
            path = os.path.join(run, group, "data.bin")
            assert os.path.getsize(path) > 0 and os.stat(path).st_mode & 0o777 == 0o600
            assert {r.file for r in swapper.records(group).values()} == {path}
    read = swapper.swap_in(["a", "b"])
    back = read.wait()
    for group, values in written.items():
        for key, value in values.items():
            assert same(back[group][key], value), (group, key)
    read.release()
    swapper.discard("a")
    if not packed:
        assert not os.path.exists(os.path.join(run, "a"))
    swapper.close()
    assert not os.path.exists(run)


@pytest.mark.parametrize("layout", ["test-subfolders", "test-two-packs"])
def test_an_offloaded_optimizer_steps_through_a_toy_layout(scratch, layout):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 32))  # two chunks of 4 KiB buffers
    reference = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 32))
    reference.load_state_dict(model.state_dict())
    config = SwapConfig(folder=str(scratch), layout=layout, pin=False, chunk_bytes=1 << 12)
    opt = OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (reference, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    names = ["all.bin"] if layout == "test-subfolders" else ["first.bin", "second.bin"]
    pack = os.path.join(opt.swapper.folder, "packed", names[0])
    assert sorted(os.listdir(os.path.dirname(pack))) == names and opt.stored_bytes() > 0
    assert all(os.path.getsize(os.path.join(os.path.dirname(pack), name)) > 0 for name in names)  # each file used
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    for key, values in plain.state_dict()["state"].items():
        for name, value in values.items():
            assert torch.equal(opt.state_dict()["state"][key][name], value)
    opt.close()
    assert not os.path.exists(os.path.dirname(pack))


def test_a_toy_codec_round_trips_and_stores_the_encoded_bytes(scratch):
    written = {"g": tensors(2), "h": {"zeros": torch.zeros(1 << 16)}}
    plain = TensorSwapper(SwapConfig(folder=str(scratch), pin=False))  # what the identity codec stores
    plain.swap_out(written).wait()
    swapper = TensorSwapper(SwapConfig(folder=str(scratch), codec="test-zlib", pin=False, checksum=True))
    swapper.swap_out(written).wait()
    for group in written:
        records = swapper.records(group)
        assert {r.codec for r in records.values()} == {"test-zlib"}
        path, stored = next(iter(records.values())).file, next(iter(records.values())).stored
        with open(path, "rb") as f:
            on_disk = f.read()
        with open(next(iter(plain.records(group).values())).file, "rb") as f:
            raw = f.read()
        assert len(on_disk) == round_up(stored) and on_disk[stored:] == bytes(len(on_disk) - stored)
        assert zlib.decompress(on_disk[:stored]) == raw  # the file holds the encoded bytes, nothing else
    assert os.path.getsize(next(iter(swapper.records("h").values())).file) < (1 << 18) // 16
    read = swapper.swap_in(["g", "h"])
    back = read.wait()
    for group, values in written.items():
        for key, value in values.items():
            assert same(back[group][key], value), (group, key)
    read.release()
    swapper.close()
    plain.close()


def test_a_corrupt_encoded_file_is_a_checksum_error_naming_it(scratch):
    with TensorSwapper(SwapConfig(folder=str(scratch), codec="test-zlib", pin=False)) as swapper:
        swapper.swap_out({"g": {"w": torch.randn(1000)}}).wait()
        path = next(iter(swapper.records("g").values())).file
        with open(path, "r+b") as f:
            f.seek(10)
            f.write(b"\xff\x00\xff\x00")
        read = swapper.swap_in(["g"])
        with pytest.raises(ChecksumError, match="test-zlib") as caught:
            read.wait()
        assert caught.value.filename == path


def test_a_codec_with_the_packed_layout_is_refused_and_unpacked_works(scratch):
    config = SwapConfig(folder=str(scratch), codec="test-zlib", pin=False)
    with pytest.raises(UnsupportedError, match="packed=False"):
        TensorSwapper(config, packed=True)
    assert os.listdir(scratch) == []
    with TensorSwapper(config, packed=False) as swapper:
        swapper.swap_out({"g": {"w": torch.arange(10.0)}}).wait()
        read = swapper.swap_in(["g"])
        assert read.wait()["g"]["w"].tolist() == list(map(float, range(10)))
        read.release()


def test_offloaded_parameters_stream_through_a_toy_codec(scratch):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(reference.state_dict())
    x = torch.randn(5, 8)
    before = dict(Zlib.calls)
    with offload_parameters(model, str(scratch), config=SwapConfig(codec="test-zlib", pin=False)) as offload:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), reference(x))
        state = offload.state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    assert Zlib.calls["encode"] > before["encode"] and Zlib.calls["decode"] > before["decode"]
