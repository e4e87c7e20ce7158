"""TensorSwapper(packed=True): many groups in one pack file, one request per swap_out and per adjacent swap_in,
extents rewritten in place or freed, the file no larger than what lives in it; random sequences against a model."""

from __future__ import annotations

import os
import random

import pytest
import torch

from deepoffload.swap.config import SwapConfig
from deepoffload.swap.pool import round_up
from deepoffload.swap.tensor_swapper import PACKED_ALIGNMENT, TensorSwapper


@pytest.fixture
def swapper(scratch):
    with TensorSwapper(SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=3), packed=True) as s:
        yield s


def counted(swapper, name):
    calls = []
    real = getattr(swapper.handle, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    setattr(swapper.handle, name, wrapper)
    return calls


def groups_of(count: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"p{i}": {
            "m": torch.randn(32, generator=gen),
            "v": torch.rand(32, generator=gen),
            "step": torch.tensor(float(i)),
        }
        for i in range(count)
    }


def test_many_groups_one_file_one_request_each_way(swapper):
    groups = groups_of(500)
    writes = counted(swapper, "write_async")
    swapper.swap_out(groups).wait()
    assert len(writes) == 1 and sorted(os.listdir(swapper.folder)) == [".deepoffload-run", "pack.swp"]
    reads = counted(swapper, "read_async")
    read = swapper.swap_in(list(groups))
    back = read.wait()
    assert len(reads) == 1
    for name, tensors in groups.items():
        for key, tensor in tensors.items():
            assert torch.equal(back[name][key], tensor)
            record = swapper.records(name)[key]
            assert record.file.endswith("pack.swp") and record.offset % PACKED_ALIGNMENT == 0
    read.release()
    size = os.path.getsize(os.path.join(swapper.folder, "pack.swp"))
    # 260 bytes per group, packed at 16 bytes: one page of padding in all, not a cache line per small tensor
    assert swapper.stored_bytes() <= size <= round_up(round_up(2 * 32 * 4 + 4, PACKED_ALIGNMENT) * len(groups))


def test_same_groups_rewrite_in_place_others_move_and_the_file_shrinks(swapper):
    path = os.path.join(swapper.folder, "pack.swp")
    groups = groups_of(8)
    first = dict(list(groups.items())[:4])
    second = dict(list(groups.items())[4:])
    swapper.swap_out(first).wait()
    swapper.swap_out(second).wait()
    offsets = {name: swapper.records(name)["m"].offset for name in groups}
    size = os.path.getsize(path)
    read = swapper.swap_in(list(first))
    again = read.wait()
    for tensors in again.values():
        tensors["m"].add_(1)
    swapper.swap_out(again, staged=read).wait()  # the same groups, same sizes: in place
    assert {name: swapper.records(name)["m"].offset for name in groups} == offsets
    assert os.path.getsize(path) == size
    assert torch.equal(swapper.swap_in(["p0"]).wait()["p0"]["m"], groups["p0"]["m"] + 1)
    # regrouped: written elsewhere, the old extent freed once no group lives there
    swapper.swap_out({"p0": groups["p0"], "p5": groups["p5"]}).wait()
    assert swapper.pack.end >= size
    for name in list(groups):
        swapper.discard(name)
    assert swapper.stored_bytes() == 0 and os.path.getsize(path) == 0 and swapper.pack.free_bytes() == 0


def test_failed_write_frees_its_extent_and_drops_the_records(swapper, monkeypatch):
    swapper.swap_out(groups_of(3)).wait()
    real = swapper.handle.write_async
    monkeypatch.setattr(
        swapper.handle, "write_async", lambda tensor, file, *a, **k: real(tensor, "/nonexistent-folder/x.swp", *a, **k)
    )
    with pytest.raises(OSError):
        swapper.swap_out({"p1": {"m": torch.ones(4096)}}).wait()
    monkeypatch.undo()
    assert swapper.records("p1") == {} and swapper.has("p0") and swapper.has("p2")
    assert torch.equal(swapper.swap_in(["p2"]).wait()["p2"]["v"], groups_of(3)["p2"]["v"])


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_match_a_model_and_extents_never_overlap(swapper, seed):
    rng = random.Random(seed)
    model: dict[str, dict[str, torch.Tensor]] = {}
    names = [f"g{i}" for i in range(12)]
    for _ in range(60):
        op = rng.random()
        chosen = rng.sample(names, rng.randint(1, 5))
        if op < 0.5:
            batch = {
                n: {f"t{k}": torch.randn(rng.choice([0, 1, 7, 300, 3000])) for k in range(rng.randint(0, 3))}
                for n in chosen
            }
            write = swapper.swap_out(batch)
            if rng.random() < 0.5:
                write.wait()
            model.update({n: {k: v.clone() for k, v in ts.items()} for n, ts in batch.items()})
        elif op < 0.85:
            stored = [n for n in chosen if swapper.has(n)]
            read = swapper.swap_in(stored)
            for name, tensors in read.wait().items():
                assert tensors.keys() == {k for k, v in model[name].items()}
                for key, value in tensors.items():
                    assert torch.equal(value, model[name][key]), (name, key)
            read.release()
        else:
            for name in chosen:
                swapper.discard(name)
                model.pop(name, None)
        swapper.wait_all()
        extents = {id(e): e for e in swapper.packing.extents.values()}.values()
        spans = sorted((e.offset, e.offset + e.nbytes) for e in extents if e.nbytes)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "extents overlap"
        live = sum(end - start for start, end in spans)
        assert swapper.pack.end == live + swapper.pack.free_bytes()


def test_whole_extent_reads_reuse_their_views_and_write_back_in_place(swapper):
    groups = groups_of(50)
    names = list(groups)
    swapper.swap_out(groups).wait()
    reads = counted(swapper, "read_async")
    first = swapper.swap_in(names)
    views = first.wait()
    assert len(reads) == 1
    for tensors in views.values():
        tensors["m"].add_(1)
    offsets = {name: swapper.records(name)["m"].offset for name in names}
    swapper.write_back(first).wait()
    assert {name: swapper.records(name)["m"].offset for name in names} == offsets
    second = swapper.swap_in(names)
    again = second.wait()  # same extent, same records, same buffer: the same view objects, the new bytes
    assert all(again[n][k] is views[n][k] for n in names for k in groups[n])
    for name, tensors in groups.items():
        assert torch.equal(again[name]["m"], tensors["m"] + 1) and torch.equal(again[name]["v"], tensors["v"])
    second.release()
    part = swapper.swap_in(names[1:3])  # not a whole extent: nothing to write back
    part.wait()
    assert swapper.write_back(part) is None
    part.release()
    stale = swapper.swap_in(names)
    stale.wait()
    swapper.swap_out({"p0": {"m": torch.zeros(32)}}).wait()  # p0 moved: the extent no longer holds exactly these
    assert swapper.write_back(stale) is None
    stale.release()
    swapper.swap_out({n: {"m": torch.full((32,), 7.0)} for n in names}).wait()  # new layout and records
    third = swapper.swap_in(names)
    fresh = third.wait()
    assert fresh["p1"]["m"] is not views["p1"]["m"] and set(fresh["p1"]) == {"m"}
    assert all(torch.equal(fresh[n]["m"], torch.full((32,), 7.0)) for n in names)
    third.detach()  # the views stay in use: the buffer leaves the pool and no extent keeps views of it
    assert swapper.packing.extents["p1"].views is None
    kept = fresh["p1"]["m"].clone()
    fourth = swapper.swap_in(names)
    assert fourth.wait()["p1"]["m"] is not fresh["p1"]["m"] and torch.equal(fresh["p1"]["m"], kept)
    fourth.release()


def test_views_are_not_reused_when_checksums_must_be_verified(scratch):
    config = SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=3, checksum=True)
    pytest.importorskip("xxhash")
    with TensorSwapper(config, packed=True) as swapper:
        groups = groups_of(4)
        swapper.swap_out(groups).wait()
        read = swapper.swap_in(list(groups))
        first = read.wait()["p2"]["m"]
        swapper.write_back(read).wait()
        path = os.path.join(swapper.folder, "pack.swp")
        record = swapper.records("p2")["m"]
        with open(path, "r+b") as f:  # flip a byte of p2's m on storage
            f.seek(record.offset)
            byte = f.read(1)
            f.seek(record.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        again = swapper.swap_in(list(groups))
        with pytest.raises(OSError, match="checksum"):
            again.wait()
        assert first.numel() == 32


def test_staged_views_hold_the_bytes_so_the_callers_tensors_can_go(swapper):
    import weakref

    groups = groups_of(3)
    expected = {name: {key: value.clone() for key, value in tensors.items()} for name, tensors in groups.items()}
    gone = weakref.ref(groups["p1"]["m"])
    write = swapper.swap_out(groups)
    views = write.staged()
    assert all(torch.equal(views[n][k], expected[n][k]) for n in expected for k in expected[n])
    del groups  # the write no longer keeps the caller's tensors alive: the staging buffer holds their bytes
    assert gone() is None
    write.wait()
    back = swapper.swap_in(list(expected)).wait()
    assert all(torch.equal(back[n][k], expected[n][k]) for n in expected for k in expected[n])


def test_pool_fit_grows_buffers_and_frees_smaller_ones():
    from deepoffload.swap.pool import BufferPool

    pool = BufferPool(3, 4096, pin=False)
    held, free = pool.try_acquire(100), pool.try_acquire(100)
    pool.release(free)
    pool.fit(5000)
    assert pool.buffer_bytes == 8192 and pool.held_bytes() == 4096  # the free small one is gone, the held one stays
    pool.release(held)  # smaller than the pool's size now: freed, not pooled again
    assert pool.held_bytes() == 0
    big = pool.try_acquire(8000)
    assert big.numel() == 8192 and pool.pooled(big)
    pool.release(big)
    assert pool.try_acquire(6000) is big  # reused
    pool.fit(100)  # never shrinks
    assert pool.buffer_bytes == 8192
