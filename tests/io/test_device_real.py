"""Device tensors on the real accelerator of this machine (CUDA, ROCm, XPU, ...): the handle, ``DeviceStager``, the
tensor swapper, the offloaded optimizer and parameter streaming. Skipped where torch sees no accelerator; run by
ci/gpu_check.sh on a machine with one. The staging logic itself is tested without hardware in
tests/io/test_device_staging.py."""

from __future__ import annotations

import pytest
import torch

from deepoffload.io import accelerator
from deepoffload.io.buffers import aligned_empty, is_pinned
from deepoffload.io.staging import DeviceStager

DEVICE = torch.accelerator.current_accelerator(check_available=True)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no accelerator on this machine")


def sample(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def test_the_current_accelerator_is_detected_and_buffers_are_page_locked_for_it():
    assert accelerator.current().device_type == DEVICE.type
    assert is_pinned(aligned_empty(1 << 20))


@pytest.mark.parametrize("numel", [1, 1023, 1_000_003, 9_000_001])
def test_handle_round_trip(handle, scratch, numel):
    t = sample(numel, seed=numel)
    handle.write(t, scratch / "d", validate=True)
    back = torch.empty_like(t)
    handle.read(back, scratch / "d")
    assert back.device == t.device and torch.equal(back, t)


def test_handle_async_round_trip(handle, scratch):
    t = sample(3_000_017, torch.bfloat16)
    handle.write_async(t, scratch / "a").wait()
    back = torch.empty_like(t)
    handle.read_async(back, scratch / "a").wait()
    assert torch.equal(back, t)


def test_stager_sees_work_queued_just_before_and_leaves_the_tensor_ready(handle, scratch):
    stager = DeviceStager(handle, chunk_bytes=1 << 20)
    t = sample(5_000_000)
    doubled = t * 2  # queued on the current stream; the staging copies must wait for it
    stager.write(doubled, scratch / "s", offset=4096)
    back = torch.zeros_like(t)
    stager.read(back, scratch / "s", offset=4096)
    assert torch.equal(back + 0, doubled)  # used at once on the current stream


def test_tensor_swapper_round_trips_device_tensors(scratch):
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.tensor_swapper import TensorSwapper

    tensors = {"a": sample(100_000), "b": sample(777, torch.float16, 1).reshape(7, 111)}
    with TensorSwapper(SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=2)) as swapper:
        swapper.swap_out({"g": tensors}).wait()
        read = swapper.swap_in(["g"])
        back = read.wait()["g"]
        for key, t in tensors.items():
            assert back[key].device == t.device and torch.equal(back[key], t)
        read.release()


def test_offloaded_optimizer_on_device_parameters_matches_in_memory_adam(scratch):
    from deepoffload.swap.config import SwapConfig
    from deepoffload.swap.optimizer import OffloadedOptimizer

    reference = [torch.nn.Parameter(sample(10_000, seed=i)) for i in range(4)]
    params = [torch.nn.Parameter(p.detach().clone()) for p in reference]
    plain = torch.optim.Adam(reference, lr=1e-2)
    config = SwapConfig(folder=str(scratch), chunk_bytes=1 << 20, buffer_count=2)
    with OffloadedOptimizer(torch.optim.Adam, params, config=config, lr=1e-2) as offloaded:
        for step in range(3):
            for a, b in zip(reference, params):
                a.grad = sample(10_000, seed=100 + step)
                b.grad = a.grad.clone()
            plain.step()
            offloaded.step()
        assert all(torch.equal(a, b) for a, b in zip(reference, params))
        state = offloaded.state_dict()["state"]
        assert all(
            v.device.type == DEVICE.type or v.dim() == 0
            for s in state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ), "the state comes back on the parameters' device"


def test_parameter_streaming_of_a_model_on_the_device(scratch):
    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import Residency, offload_parameters
    from tests.support.models import ModelSize, SyntheticText, build_model

    size = ModelSize(vocab=64, width=32, layers=4, heads=2, context=16, batch=3)
    reference, model = build_model(size).to(DEVICE), build_model(size).to(DEVICE)
    tokens = SyntheticText(size, 0).batch()[:, :-1].to(DEVICE)
    with offload_parameters(model, str(scratch), stream=StreamOptions(prefetch=1)) as offload:
        assert all(
            b.state is Residency.ON_STORAGE and p.device.type == DEVICE.type
            for b in offload.blocks
            for p in b.module.parameters()
        )
        with torch.no_grad():
            assert torch.equal(model(tokens), reference(tokens))
    trained, ref = build_model(size).to(DEVICE), build_model(size).to(DEVICE)
    optimizer = torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = SyntheticText(size)
    with offload_parameters(
        trained, str(scratch), train=TrainOptions(mode="grads", optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    ) as offload:
        for _ in range(2):
            batch = data.batch().to(DEVICE)
            optimizer.zero_grad()
            loss = ref.loss(batch)
            loss.backward()
            optimizer.step()
            streamed = trained.loss(batch)
            streamed.backward()
            offload.step()
            offload.zero_grad()
            torch.testing.assert_close(streamed, loss)
