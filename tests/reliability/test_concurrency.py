"""Concurrency inside one process: threads sharing a handle, several handles (one per engine) with transfers in
flight at once, and several threads waiting on the same request. Every byte is checked."""

from __future__ import annotations

import itertools
import threading

import torch

from deepoffload import AsyncIOHandle, aligned_empty

THREADS = 8
PER_THREAD = 6


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def run_threads(target, count: int) -> None:
    """Run ``target(i)`` in ``count`` threads started together; re-raise the first failure here."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_eight_threads_share_one_handle(aio, scratch):
    """Each thread keeps several writes, then several reads, in flight on the shared handle (sizes that are not
    block multiples, aligned and unaligned buffers, a common file written at disjoint offsets)."""
    shared = scratch / "shared.bin"
    slot = 1 << 20
    with AsyncIOHandle(block_size=65536, queue_depth=8, intra_op_parallelism=2) as h:

        def work(i: int) -> None:
            tensors = [random_bytes(50_000 + 37_123 * k + i, seed=100 * i + k) for k in range(PER_THREAD)]
            writes = [h.write_async(t, scratch / f"t{i}-{k}") for k, t in enumerate(tensors)]
            common = random_bytes(slot, seed=i)
            writes.append(h.write_async(common, shared, i * slot, truncate=False))
            assert [w.wait() for w in writes] == [t.numel() for t in tensors] + [slot]
            outs = [aligned_empty(t.numel()) if k % 2 else torch.empty_like(t) for k, t in enumerate(tensors)]
            reads = [h.read_async(o, scratch / f"t{i}-{k}") for k, o in enumerate(outs)]
            common_back = aligned_empty(slot)
            reads.append(h.read_async(common_back, shared, i * slot))
            for r in reversed(reads):  # collected in another order than submitted
                r.wait()
            for k, (o, t) in enumerate(zip(outs, tensors)):
                assert torch.equal(o, t), f"thread {i} tensor {k} differs"
            assert torch.equal(common_back, common), f"thread {i}: its slot of the shared file differs"

        run_threads(work, THREADS)
        assert h.pending() == 0 and h.wait_all() == 0
    assert shared.stat().st_size == THREADS * slot


def test_four_handles_with_transfers_in_flight_at_once(engines, scratch):
    """Four handles (cycling over the usable engines, with different settings) each with several transfers
    submitted before any is waited for; waited in reverse order, from different threads."""
    settings = [
        dict(block_size=4096, queue_depth=1),
        dict(block_size=65536, queue_depth=4, single_submit=True),
        dict(intra_op_parallelism=3, overlap_events=False),
        dict(intra_op_parallelism=4, queue_depth=64),
    ]
    handles = [AsyncIOHandle(engine=engine, **kw) for engine, kw in zip(itertools.cycle(engines), settings)]
    try:
        tensors = [random_bytes(3 * 1024 * 1024 + 777 * i, seed=i) for i in range(12)]
        writes = [handles[i % 4].write_async(t, scratch / f"h{i}") for i, t in enumerate(tensors)]
        run_threads(lambda i: [w.wait() for w in writes[i::4][::-1]], 4)
        outs = [torch.empty_like(t) for t in tensors]
        reads = [handles[(i + 1) % 4].read_async(o, scratch / f"h{i}") for i, o in enumerate(outs)]
        assert sum(h.wait_all() for h in handles) == 12
        assert all(r.done() for r in reads)
        for i, (o, t) in enumerate(zip(outs, tensors)):
            assert torch.equal(o, t), f"tensor {i} differs ({handles[(i + 1) % 4]})"
    finally:
        for h in handles:
            h.close()


def test_threads_waiting_on_the_same_request_all_get_its_result(handle, scratch):
    data = random_bytes(32 << 20, seed=7)
    missing = scratch / "missing" / "x"
    good = handle.write_async(data, scratch / "w")
    bad = handle.read_async(torch.empty(10, dtype=torch.uint8), missing)
    results: list[object] = [None] * THREADS

    def wait(i: int) -> None:
        try:
            results[i] = (good if i % 2 else bad).wait()
        except OSError as e:
            results[i] = e

    run_threads(wait, THREADS)
    assert results[1::2] == [data.numel()] * (THREADS // 2)
    errors = results[0::2]
    assert all(isinstance(e, FileNotFoundError) for e in errors), errors
    assert len({id(e) for e in errors}) == 1, "every waiter sees the same error"
    back = torch.empty_like(data)
    handle.read(back, scratch / "w")
    assert torch.equal(back, data)
