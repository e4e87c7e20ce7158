"""The thread-safety contract (dev-notes/p27.md): objects documented as shareable between threads, used from
several threads at once, give each thread its own answer and lose nothing."""

from __future__ import annotations

import os
import threading

import torch

from deepoffload.io.compat import aio_handle

BLOCK = 4096


def test_concurrent_sync_preads_on_one_deepspeed_handle_each_count_one(scratch):
    # DeepSpeed's own test_concurrent_blocking_reads_on_shared_handle: two threads' sync_pread on one handle must
    # return (1, 1); a synchronous call here collected the other thread's operation too and returned (2, 1)
    payloads = [os.urandom(BLOCK) for _ in range(2)]
    paths = []
    for i, payload in enumerate(payloads):
        paths.append(scratch / f"source-{i}.bin")
        paths[-1].write_bytes(payload)
    handle = aio_handle(BLOCK, 2, True, True, 2)
    for _ in range(30):
        buffers = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(2)]
        start = threading.Barrier(3, timeout=30)
        statuses, errors = [None, None], []

        def read(i):
            try:
                start.wait()
                statuses[i] = handle.sync_pread(buffers[i], str(paths[i]), 0)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()
        start.wait()
        for reader in readers:
            reader.join(timeout=30)
        assert not errors and statuses == [1, 1]
        assert [bytes(b.tolist()) for b in buffers] == payloads


def test_each_asynchronous_operation_is_counted_once_across_threads(scratch):
    path = scratch / "f.bin"
    path.write_bytes(os.urandom(BLOCK))
    handle = aio_handle(BLOCK, 8, False, False, 1)
    counts, lock = [], threading.Lock()

    def work():
        total = 0
        buffers = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(3)]
        for _ in range(20):
            for b in buffers:
                handle.async_pread(b, str(path), 0)
            total += handle.sync_pread(torch.zeros(BLOCK, dtype=torch.uint8), str(path), 0) - 1
            total += handle.wait()
        with lock:
            counts.append(total)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(counts) == 3 * 20 * 3 and handle.wait() == 0


def test_state_dict_from_another_thread_during_step_waits_for_the_step(scratch):
    # raised a bare KeyError(<id>) while step() had the state of some parameters on storage and some in memory
    import deepoffload

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2000)) for _ in range(24)]
    opt = deepoffload.OffloadedOptimizer(
        torch.optim.Adam,
        params,
        lr=0.01,
        config=deepoffload.SwapConfig(folder=str(scratch), pin=False, chunk_bytes=64 << 10),
    )
    steps, errors, snapshots = 15, [], []

    def train():
        try:
            for _ in range(steps):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        while trainer.is_alive():
            snapshots.append(opt.state_dict())
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    trainer.join()
    try:
        assert not errors, errors
        for snapshot in snapshots:  # each a whole state after some step: every parameter at the same step
            counts = {float(v["step"]) for v in snapshot["state"].values()}
            assert len(counts) <= 1 and (not counts or len(snapshot["state"]) == len(params)), counts
        final = opt.state_dict()["state"]
        assert {float(v["step"]) for v in final.values()} == {float(steps)}
    finally:
        opt.close()


def test_request_done_polled_while_another_thread_collects_never_raises(scratch):
    # Request.done() raised "unknown op id" when wait_all() on another thread had just collected the request
    from deepoffload import AsyncIOHandle

    path = scratch / "f.bin"
    path.write_bytes(os.urandom(1 << 16))
    handle = AsyncIOHandle(intra_op_parallelism=2)
    errors = []
    try:
        for _ in range(40):
            buffers = [torch.empty(4096, dtype=torch.uint8) for _ in range(16)]
            requests = [handle.read_async(b, path, 4096 * i) for i, b in enumerate(buffers)]
            stop = threading.Event()

            def poll():
                try:
                    while not stop.is_set():
                        if all([r.done() for r in requests]):
                            return
                except Exception as e:  # noqa: BLE001  (reported below)
                    errors.append(e)

            poller = threading.Thread(target=poll)
            poller.start()
            assert handle.wait_all() == 16
            stop.set()
            poller.join()
            assert not errors, errors
            assert all(r.done() for r in requests) and handle.pending() == 0
    finally:
        handle.close()
