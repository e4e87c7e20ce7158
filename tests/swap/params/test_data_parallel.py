"""Data-parallel streaming (``TrainOptions(optimizer, data_parallel=True)``) against DistributedDataParallel in
memory, bit for bit, with torchrun on gloo (127.0.0.1 only): 2 ranks on one node, and 2 nodes (two torchrun
processes joined by a c10d rendezvous) with per-node swap folders; and the wrappings that cannot hold a streamed
model (DDP or FSDP2 around it, either order; ``step_in_backward`` under DDP), refused naming what to use."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepoffload import TrainOptions, offload_parameters
from deepoffload.errors import UnsupportedError
from deepoffload.swap.params.guards import wrappers
from deepoffload.swap.params.training import data_parallel

HERE = Path(__file__).resolve().parent  # the child-process scripts lie beside this file
REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_PORT"):
        env.pop(name, None)
    return env


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def check_ranks(out: Path, swap: Path, nodes: int) -> list[dict]:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert sorted(r["node"] for r in results) == ([0, 0] if nodes == 1 else [0, 1])
    for r in results:
        for mode in ("fused", "grads"):
            m = r[mode]
            assert m["losses_equal"] and m["state_equal"], (r["rank"], mode, m)  # bit-identical to DDP
            assert m["moved"] > 1e-3 and m["left_in_swap_folder"] == [], m
        assert r["ranks_agree"]
    # each rank's swap files went under its node's folder and were removed on close()
    folders = sorted(str(p.relative_to(swap)) for p in swap.glob("node*/local*"))
    assert folders == (["node0/local0", "node0/local1"] if nodes == 1 else ["node0/local0", "node1/local0"])
    assert not any(p.is_file() for p in swap.rglob("*"))
    return results


@pytest.mark.slow  # two ranks import torch and train DDP and streamed twice (about 20 s)
def test_two_ranks_equal_ddp_bit_for_bit(scratch):
    out, swap = scratch / "out", scratch / "swap"
    out.mkdir()
    proc = subprocess.run(
        torchrun(
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(HERE / "data_parallel_worker.py"),
            str(out),
            str(swap),
        ),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=scratch,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    check_ranks(out, swap, nodes=1)


@pytest.mark.slow  # two torchrun node processes, one rank each (about 25 s)
def test_two_nodes_equal_ddp_bit_for_bit(scratch):
    out, swap = scratch / "out", scratch / "swap"
    out.mkdir()
    port = free_port()
    nodes = [
        subprocess.Popen(
            torchrun(
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "deepoffload-x30",
                "--local-addr",
                "127.0.0.1",
                str(HERE / "data_parallel_worker.py"),
                str(out),
                str(swap),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=scratch,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=600))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert all(n.returncode == 0 for n in nodes), "\n".join(o[0][-2000:] + o[1][-4000:] for o in outputs)
    check_ranks(out, swap, nodes=2)


@pytest.mark.slow  # a child imports torch.distributed and sets up gloo (about 8 s)
def test_wrappings_that_cannot_hold_a_streamed_model_are_refused(scratch):
    env = {**child_env(), "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, str(HERE / "data_parallel_refusals.py"), str(scratch / "swap")],
        capture_output=True,
        text=True,
        env=env,
        cwd=scratch,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("ddp_then_offload", "ddp_wrapper_offloaded", "offload_then_ddp"):
        assert "DistributedDataParallel" in r[case] and "data_parallel=True" in r[case], (case, r[case])
    assert r["ddp_then_offload"].startswith("ValueError") and r["offload_then_ddp"].startswith("StreamedParameterError")
    for case in ("offload_then_fully_shard", "fully_shard_then_offload"):
        assert "fully_shard" in r[case] and "OffloadedOptimizer" in r[case] and "ZeRO-3" in r[case], r[case]
        assert "data_parallel=True" in r[case]
    assert r["bad_data_parallel"].startswith("TypeError") and "ProcessGroup" in r["bad_data_parallel"]
    assert "checkpoint=" in r["meta_without_checkpoint"] and "strict=True" in r["meta_without_checkpoint"]
    for case in ("step_in_backward_under_ddp", "ddp_after_step_in_backward"):
        step = r[case]
        assert step.startswith("UnsupportedError") and "DistributedDataParallel" in step and "unaveraged" in step, step
    assert r["failed_setup"].startswith("OSError") and r["hooks_left_after_failed_setup"] == [0, 0]
    assert r["left"] == []


def test_data_parallel_needs_an_initialised_process_group(tmp_path):
    with pytest.raises(RuntimeError, match="init_process_group"):
        offload_parameters(
            nn.Sequential(nn.Linear(2, 2)), str(tmp_path), train=TrainOptions(torch.optim.SGD, data_parallel=True)
        )
    assert list(tmp_path.iterdir()) == []


def test_buckets_keep_order_and_split_by_dtype_and_size(monkeypatch):
    monkeypatch.setattr(data_parallel, "BUCKET_BYTES", 64)
    grads = [
        torch.zeros(4),
        torch.zeros(8),
        torch.zeros(8),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(100),
        torch.zeros(1),
    ]
    assert data_parallel._buckets(grads) == [[0, 1], [2], [3], [4], [5]]


def test_wrapper_detection_looks_at_the_calling_code_only():
    assert wrappers.wrapper_in_stack() is None
    assert wrappers._path_has("/x/site-packages/torch/nn/parallel/distributed.py", wrappers._DDP_FILE)
    assert not wrappers._path_has("/x/torch/nn/parallel/data_parallel.py", wrappers._DDP_FILE)
    assert wrappers._path_has("/x/torch/distributed/fsdp/_fully_shard/_fully_shard.py", wrappers._FSDP_DIR)


class PairedDist:
    """torch.distributed for two ranks simulated by two threads: all_reduce exchanges the tensors through a barrier
    and combines them as the op says (SUM or MAX), as a real backend does."""

    ReduceOp = torch.distributed.ReduceOp
    group = SimpleNamespace(WORLD=None)  # the default group: no device types, so checks go on the CPU

    def __init__(self):
        import threading

        self.barrier = threading.Barrier(2, timeout=10)
        self.local = threading.local()
        self.slots: list = [None, None]
        self.calls = [0, 0]

    def get_world_size(self, group=None):
        return 2

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        rank = self.local.rank
        self.calls[rank] += 1
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        other = self.slots[1 - rank]
        assert other.shape == tensor.shape and other.dtype == tensor.dtype  # a backend would fail on a mismatch
        combined = torch.maximum(tensor, other) if op == torch.distributed.ReduceOp.MAX else tensor + other
        self.barrier.wait()
        tensor.copy_(combined)
        return FakeWork() if async_op else None


class FakeWork:
    def wait(self):
        return True


def two_ranks(monkeypatch, fn) -> tuple[list, PairedDist]:
    """``fn(rank)`` run by two threads as the two ranks of a PairedDist: what each returned or raised, and the fake."""
    import threading

    fake = PairedDist()
    monkeypatch.setattr(data_parallel, "dist", fake)
    outcome: list = [None, None]

    def run(r: int) -> None:
        fake.local.rank = r
        try:
            outcome[r] = fn(r)
        except RuntimeError as e:
            outcome[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return outcome, fake


def test_average_is_ddps_arithmetic_and_uneven_gradients_raise(monkeypatch):
    grads = [
        {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([[0.1, 0.2], [0.3, 0.4]])},
        {"a": torch.tensor([2.0, 5.0]), "b": torch.tensor([[0.5, 0.7], [0.9, 1.1]])},
    ]
    out, _ = two_ranks(
        monkeypatch, lambda r: data_parallel.GradientAverager().average_dict(["a", "b", "c"], grads[r], "block 0")
    )
    for r in (0, 1):
        assert sorted(out[r]) == ["a", "b"]  # no rank has a gradient of c: it stays absent
        for name in out[r]:
            expected = grads[0][name] * 0.5 + grads[1][name] * 0.5  # DDP: each times 1 / world_size, then summed
            assert torch.equal(out[r][name], expected) and out[r][name].shape == grads[r][name].shape
    # rank 0 has only a gradient of a, rank 1 of both
    partial = [{"a": grads[0]["a"]}, grads[1]]
    out, fake = two_ranks(
        monkeypatch, lambda r: data_parallel.GradientAverager().average_dict(["a", "b"], partial[r], "block 3")
    )
    for r in (0, 1):
        assert isinstance(out[r], RuntimeError), out[r]
        assert "block 3: the gradients of b exist on some ranks but not on others" in str(out[r])
    assert fake.calls == [1, 1]  # raised before any gradient bucket was reduced (on every rank alike)


def test_ranks_averaging_different_blocks_of_the_same_shape_raise_on_every_rank(monkeypatch):
    # LayerDrop-like: rank 0 back-propagates blocks.2 while rank 1 (which dropped it) is at blocks.1. Same names and
    # shapes, so the collectives match in size: without a check the two blocks' gradients are averaged together and
    # the ranks drift apart silently.
    def average(r: int):
        grads = {"w": torch.full((3,), float(r + 1)), "b": torch.full((2,), float(r + 1))}
        return data_parallel.GradientAverager().average_dict(["w", "b"], grads, f"block blocks.{2 - r}")

    out, fake = two_ranks(monkeypatch, average)
    for r in (0, 1):
        assert isinstance(out[r], RuntimeError), (r, out[r])
        assert f"block blocks.{2 - r}: other ranks are averaging something different" in str(out[r]), out[r]
    assert fake.calls == [1, 1]  # no gradient bucket was reduced


def test_parameters_outside_blocks_are_averaged_after_a_backward_that_failed(monkeypatch):
    # A backward raising after a parameter outside the blocks got its gradient (here: upstream of it; in practice the
    # uneven-gradients error above, raised on every rank and caught to skip the batch) never runs the callback it
    # queued. The next backward must queue its own, or those parameters are never averaged again and the ranks drift.
    class OneRank:
        group = SimpleNamespace(WORLD=None)

        def get_world_size(self, group=None):
            return 1

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("failed upstream")

    monkeypatch.setattr(data_parallel, "dist", OneRank())
    model = nn.Linear(2, 2)
    dp = data_parallel.DataParallel(None, model, list(model.parameters()), ["weight", "bias"])
    averaged: list[list[str]] = []
    monkeypatch.setattr(
        dp.averager, "average", lambda named, where: averaged.append([n for n, _ in named]) or [g for _, g in named]
    )
    x = torch.ones(1, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="failed upstream"):
        model(Fails.apply(x)).sum().backward()
    assert averaged == []
    model(x).sum().backward()
    assert averaged == [["weight", "bias"]]
    model(x).sum().backward()
    assert averaged == [["weight", "bias"]] * 2
    dp.close()


def test_parameters_outside_blocks_are_averaged_once_per_backward_with_reentrant_checkpoints(monkeypatch):
    # A block inside a reentrant torch.utils.checkpoint back-propagates in a nested backward of its own: its
    # end-of-backward call must not average the parameters outside the blocks again (an embedding's all_reduce per
    # block); one average at the end of the outer backward, after every gradient is complete.
    class OneRank:
        group = SimpleNamespace(WORLD=None)

        def get_world_size(self, group=None):
            return 1

    monkeypatch.setattr(data_parallel, "dist", OneRank())
    head, body = nn.Linear(2, 2), nn.Linear(2, 2)

    def block(x):  # what a streamed block's backward does: it calls end_of_backward_pending
        out = body(x)
        if out.requires_grad:
            out.register_hook(lambda g: dp.end_of_backward_pending())
        return out

    class Model(nn.Module):
        def forward(self, x):
            return head(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True))

    model = Model()
    dp = data_parallel.DataParallel(None, model, list(head.parameters()), ["head.weight", "head.bias"])
    averaged: list[list[str]] = []
    monkeypatch.setattr(
        dp.averager, "average", lambda named, where: averaged.append([n for n, _ in named]) or [g for _, g in named]
    )
    x = torch.ones(1, 2, requires_grad=True)
    for k in (1, 2):
        model(x).sum().backward()
        assert averaged == [["head.weight", "head.bias"]] * k
    dp.close()


def test_rank_local_forwards_broadcast_nothing_and_refuse_a_backward(monkeypatch):
    # Evaluation on one rank (`if rank == 0: evaluate(model)`) waited forever in the buffer broadcast that every
    # data-parallel forward starts; rank_local() is DDP's `ddp.module(...)`: no collective, and no backward.
    class Recording:
        broadcasts = 0
        group = SimpleNamespace(WORLD=None)

        def get_world_size(self, group=None):
            return 2

        def broadcast(self, tensor, src, group=None):
            Recording.broadcasts += 1

    monkeypatch.setattr(data_parallel, "dist", Recording())
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    dp = data_parallel.DataParallel(None, model, list(model.parameters()), ["0.weight", "0.bias", "1.weight", "1.bias"])
    x = torch.randn(4, 2)
    model(x)
    assert Recording.broadcasts == 3  # running mean, variance, batch count
    with dp.rank_local():
        out = model(x)
        assert Recording.broadcasts == 3
        with pytest.raises(UnsupportedError, match=r"a backward inside ParameterOffload.rank_local\(\)"):
            out.sum().backward()
    model(x)
    assert Recording.broadcasts == 6  # outside it again, every forward broadcasts
    dp.close()


def test_checks_go_where_the_groups_backend_reduces(monkeypatch):
    # the presence check was always a CPU tensor: NCCL, which reduces CUDA tensors only, would refuse it
    def group(*types):
        return SimpleNamespace(_device_types=[torch.device(t) for t in types])

    assert data_parallel.control_device(group("cpu")) == torch.device("cpu")
    assert data_parallel.control_device(group("cpu", "cuda")) == torch.device("cpu")  # gloo beside nccl
    assert data_parallel.control_device(group()) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert data_parallel.control_device(group("cuda")) == torch.device("cuda", 3)
