"""The ``lossless`` codec (``deepoffload/swap/codecs/lossless.py``): bf16/fp16 stored with their exponent byte plane
compressed, bit for bit, in fewer bytes; a changed stored byte anywhere is a ``ChecksumError`` naming the file; records
written without a codec still read; streamed parameters through it compute exactly what the model in memory does."""

from __future__ import annotations

import os

import pytest
import torch

from deepoffload import OffloadedOptimizer, SwapConfig, TensorSwapper, offload_parameters
from deepoffload.errors import ChecksumError, UnsupportedError
from deepoffload.swap.codecs import codec_class, codec_names
from deepoffload.swap.codecs.lossless import HEADER

pytest.importorskip("zstandard")


def awkward(dtype: torch.dtype, n: int = 4099, seed: int = 0) -> torch.Tensor:
    """Normal values plus every special pattern: +-0, +-inf, NaNs with payloads, subnormals, the extremes."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g).to(dtype)
    bits = values.view(torch.int16)
    special = torch.tensor(
        [0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC1, -0x0001, 0x0001, 0x7F7F, 0x0080], dtype=torch.int16
    )
    bits[: special.numel()] = special
    return values


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_it_is_registered():
    assert "lossless" in codec_names()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4096, 1 << 20])
def test_encode_decode_is_bit_exact_for_any_length(n):
    codec = codec_class("lossless")()
    source = torch.randint(0, 256, (n,), dtype=torch.uint8)
    out = torch.zeros(codec.max_stored_bytes(n), dtype=torch.uint8)
    stored = codec.encode(source, out)
    back = torch.empty(n, dtype=torch.uint8)
    assert codec.decode(out[:stored].clone(), back) == n
    assert torch.equal(back, source)


def test_tensors_round_trip_bit_for_bit_in_fewer_bytes(scratch):
    written = {
        "block": {
            "bf16": awkward(torch.bfloat16, n=4097).reshape(17, 241),
            "fp16": awkward(torch.float16, seed=1),
            "fp32": torch.randn(1000),
            "odd": torch.arange(7, dtype=torch.uint8),
            "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        },
        "weights": {"w": torch.randn(512, 512).to(torch.bfloat16)},
    }
    with TensorSwapper(SwapConfig(folder=str(scratch), codec="lossless", pin=False)) as swapper:
        swapper.swap_out(written).wait()
        record = next(iter(swapper.records("weights").values()))
        assert record.codec == "lossless"
        # random normal bf16: the exponent plane compresses to under a half, the whole to under 0.72
        assert record.stored <= 0.72 * record.nbytes
        assert os.path.getsize(record.file) < 0.73 * record.nbytes
        read = swapper.swap_in(list(written))
        back = read.wait()
        for group, values in written.items():
            for key, value in values.items():
                assert same(back[group][key], value), (group, key)
        read.release()


@pytest.mark.parametrize("where", ["header", "high plane", "low plane"])
def test_a_changed_stored_byte_is_a_checksum_error_naming_the_file(scratch, where):
    with TensorSwapper(SwapConfig(folder=str(scratch), codec="lossless", pin=False)) as swapper:
        swapper.swap_out({"g": {"w": torch.randn(4096).to(torch.bfloat16)}}).wait()
        record = swapper.records("g")["w"]
        with open(record.file, "rb") as f:
            head = HEADER.unpack(f.read(HEADER.size))
        high = head[3]
        position = {"header": 9, "high plane": HEADER.size + high // 2, "low plane": record.stored - 3}[where]
        with open(record.file, "r+b") as f:
            f.seek(position)
            byte = f.read(1)
            f.seek(position)
            f.write(bytes([byte[0] ^ 0x10]))
        read = swapper.swap_in(["g"])
        with pytest.raises(ChecksumError, match="lossless") as caught:
            read.wait()
        assert caught.value.filename == record.file


def test_records_written_without_a_codec_still_read(scratch):
    """A record that names no codec (as every record did before codecs) is read as stored bytes."""
    value = torch.randn(300).to(torch.bfloat16)
    with TensorSwapper(SwapConfig(folder=str(scratch), pin=False)) as plain:
        plain.swap_out({"g": {"w": value}}).wait()
        record = plain.records("g")["w"]
        assert (record.codec, record.stored) == ("none", 0)
        with TensorSwapper(SwapConfig(folder=str(scratch), codec="lossless", pin=False)) as swapper:
            swapper.map_group("g", {"w": record})
            read = swapper.swap_in(["g"])
            assert same(read.wait()["g"]["w"], value)
            read.release()


def test_the_packed_layout_refuses_it_at_the_first_call_and_its_advice_works(scratch):
    config = SwapConfig(folder=str(scratch), codec="lossless", pin=False)
    with pytest.raises(UnsupportedError, match="packed=False"):
        TensorSwapper(config, packed=True)
    model = torch.nn.Linear(8, 8)
    with pytest.raises(UnsupportedError, match=r"config.replace\(codec='none'\)"):
        OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config, lr=1e-3)
    with OffloadedOptimizer(torch.optim.AdamW, model.parameters(), config.replace(codec="none"), lr=1e-3) as opt:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # the advice: the optimizer's state uncompressed
        assert opt.stored_bytes() > 0


def test_streamed_bf16_parameters_through_it_compute_exactly_and_read_fewer_bytes(scratch):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    read = {}
    for codec in ("none", "lossless"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(torch.bfloat16)
        model.load_state_dict(reference.state_dict())
        config = SwapConfig(codec=codec, pin=False)
        with offload_parameters(model, str(scratch), config=config) as offload:
            before = offload.stats.bytes_read
            with torch.no_grad():
                for _ in range(2):
                    assert same(model(x), expected)
            read[codec] = offload.stats.bytes_read - before
    assert 0 < read["lossless"] <= 0.75 * read["none"]


def test_loading_a_checkpoint_through_it_writes_each_block_encoded(scratch):
    safetensors = pytest.importorskip("safetensors.torch")
    from deepoffload import LoadOptions

    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
    checkpoint = scratch / "model.safetensors"
    safetensors.save_file(reference.state_dict(), str(checkpoint))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    config = SwapConfig(codec="lossless", pin=False)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
    load = LoadOptions(checkpoint=str(checkpoint))
    with offload_parameters(model, str(scratch), load=load, config=config) as offload, torch.no_grad():
        assert same(model(x), expected)
        assert {r.codec for b in offload.blocks for r in offload.store.swapper.records(b.group).values()} == {
            "lossless"
        }


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_training_through_it_steps_exactly_as_in_memory(scratch, mode):
    """Blocks are written encoded after each step; the optimizer's packed state stays as it is (codec none)."""
    from deepoffload import TrainOptions

    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]).to(torch.bfloat16)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train = TrainOptions(lambda ps: torch.optim.AdamW(ps, lr=1e-2), mode=mode)
    config = SwapConfig(codec="lossless", pin=False)
    batches = [torch.randn(4, 32).to(torch.bfloat16) for _ in range(3)]
    with offload_parameters(model, str(scratch), train=train, config=config) as offload:
        for x in batches:
            reference(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            model(x).float().square().mean().backward()
            offload.step()
            offload.zero_grad()
        state = offload.state_dict()
        assert {r.codec for b in offload.blocks for r in offload.store.swapper.records(b.group).values()} == {
            "lossless"
        }
    for key, value in reference.state_dict().items():
        assert same(state[key], value), key


def test_the_memory_plan_counts_the_encoded_bytes_beside_each_block_in_flight(scratch):
    """A read holds a block's stored bytes until they are decoded into its staging buffer, a write its encoded copy:
    the plan behind max_memory counts S = max_stored_bytes(B) per block in flight, which codec none does not hold."""
    plans = {}
    for codec in ("none", "lossless"):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
        with offload_parameters(model, str(scratch), config=SwapConfig(codec=codec, pin=False)) as offload:
            plans[codec] = offload.plan
    block = plans["none"].block_bytes
    assert plans["none"].stored_bytes == 0
    assert plans["lossless"].stored_bytes == codec_class("lossless")().max_stored_bytes(block)
    extra = plans["lossless"].staging_bytes - plans["none"].staging_bytes
    assert extra == (plans["none"].prefetch + 2) * plans["lossless"].stored_bytes


def test_decoding_runs_on_the_pool_before_the_caller_waits(scratch, monkeypatch):
    """Each group is decoded by a pool thread as soon as its own read is done (while the caller computes), not by
    the caller's ``wait``; a read released without a wait still waits for its decodes before the buffer goes."""
    import threading
    import time

    from deepoffload.swap.codecs.lossless import Lossless

    threads: list[str] = []
    real = Lossless.decode

    def recording(self, stored, out):
        threads.append(threading.current_thread().name)
        return real(self, stored, out)

    monkeypatch.setattr(Lossless, "decode", recording)
    written = {f"g{i}": {"w": torch.randn(64, 1024).to(torch.bfloat16)} for i in range(3)}
    with TensorSwapper(SwapConfig(folder=str(scratch), codec="lossless", pin=False)) as swapper:
        swapper.swap_out(written).wait()
        read = swapper.swap_in(list(written))
        deadline = time.monotonic() + 60
        while len(threads) < 3 and time.monotonic() < deadline:  # nobody waits: the pool decodes on its own
            time.sleep(0.01)
        assert len(threads) == 3 and all(name.startswith("deepoffload-decode") for name in threads)
        back = read.wait()
        assert all(same(back[g]["w"], written[g]["w"]) for g in written)
        read.release()
        unwaited = swapper.swap_in(list(written))
        unwaited.release()  # waits for its decodes first
        assert len(threads) == 6
