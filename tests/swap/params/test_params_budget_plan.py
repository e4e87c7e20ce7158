"""The memory plan behind ``max_memory=`` (deepoffload.swap.params.budget): bytes parsing, the parts of the plan and
the settings ``fit`` chooses for a limit, or its refusal naming the least limit that works."""

from __future__ import annotations

import pytest
import torch

from deepoffload.errors import MemoryBudgetError
from deepoffload.swap.params.budget import MIN_STATE_CHUNKS, READER_BYTES, SETUP_BLOCKS, MemoryPlan, fit, parse_bytes

MiB = 1 << 20


@pytest.mark.parametrize(
    "text,expected",
    [
        ("6GB", 6 * 10**9),
        ("512MiB", 512 * MiB),
        ("1.5 GB", 1_500_000_000),
        ("4096", 4096),
        ("2gib", 2 << 30),
        (123, 123),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6 apples", "", "-1GB", "GB", 0, -5, 1.5, True, None])
def test_parse_bytes_refuses_what_is_not_bytes(bad):
    with pytest.raises((ValueError, TypeError), match="max_memory"):
        parse_bytes(bad)


def test_plan_parts_add_up():
    plan = MemoryPlan(block_bytes=16 * MiB, rest_bytes=MiB, prefetch=2, training=True, state_chunks=6)
    assert plan.setup_bytes == MiB + READER_BYTES + SETUP_BLOCKS * 16 * MiB
    assert plan.staging_bytes == 4 * 16 * MiB
    assert plan.optimizer_bytes == 6 * 16 * MiB + 6 * MiB  # the outside optimizer's buffers are its own size
    assert plan.run_bytes == 2 * MiB + plan.staging_bytes + plan.optimizer_bytes + plan.working_bytes
    assert plan.peak_bytes == max(plan.setup_bytes, plan.run_bytes)
    assert dict(plan.parts())["peak (max of setup and running)"] == plan.peak_bytes
    inference = MemoryPlan(block_bytes=16 * MiB, rest_bytes=MiB, prefetch=2)
    assert inference.optimizer_bytes == 0 and inference.run_bytes < plan.run_bytes


def test_fit_chooses_the_deepest_prefetch_that_fits_and_keeps_blocks_with_the_rest():
    plan = MemoryPlan(block_bytes=16 * MiB, rest_bytes=MiB, prefetch=3, training=True, resident_bytes=None)
    roomy = fit(plan, 4 << 30, process=200 * MiB)
    assert roomy.plan.prefetch == 3 and roomy.plan.state_chunks == 6 and roomy.plan.resident_bytes > 0
    assert roomy.expected_peak_bytes <= 4 << 30
    least = MemoryPlan(16 * MiB, MiB, prefetch=0, training=True, state_chunks=MIN_STATE_CHUNKS)
    tight = fit(plan, 200 * MiB + least.peak_bytes + 64 * MiB, process=200 * MiB)
    assert tight.plan.prefetch == 0 and tight.plan.state_chunks == MIN_STATE_CHUNKS
    assert tight.plan.resident_bytes == 0
    asked = fit(MemoryPlan(16 * MiB, MiB, resident_bytes=32 * MiB), 4 << 30, process=200 * MiB)
    assert asked.plan.resident_bytes == 32 * MiB  # what the caller asked, no more


def test_fit_refuses_at_once_with_the_least_limit_that_works():
    plan = MemoryPlan(block_bytes=16 * MiB, rest_bytes=MiB, prefetch=1, training=True)
    least = (
        200 * MiB
        + MemoryPlan(16 * MiB, MiB, prefetch=0, training=True, state_chunks=MIN_STATE_CHUNKS).peak_bytes
        + 64 * MiB
    )
    with pytest.raises(MemoryBudgetError, match=f"the least that works is {least} bytes") as caught:
        fit(plan, least - 1, process=200 * MiB)
    assert "process now" in str(caught.value) and "largest block" in str(caught.value)
    assert fit(plan, least, process=200 * MiB).expected_peak_bytes <= least


def tower():
    from torch import nn

    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 256), *(nn.Linear(256, 256) for _ in range(4)), nn.Linear(256, 2))


def test_max_memory_too_small_is_refused_at_once_with_the_least_that_works(scratch):
    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import offload_parameters

    model = tower()
    with pytest.raises(MemoryBudgetError, match=r"max_memory=100000000 bytes .* the least that works is \d+ bytes"):
        offload_parameters(
            model,
            str(scratch),
            train=TrainOptions(optimizer=torch.optim.Adam),
            stream=StreamOptions(max_memory="100MB"),
        )
    assert all(p.is_meta for p in model.parameters())  # nothing was made, read or written
    assert not any(scratch.iterdir())


def test_the_limit_the_refusal_advises_works_after_the_process_grew(scratch):
    import re

    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import offload_parameters

    with pytest.raises(MemoryBudgetError) as refused:
        offload_parameters(
            tower(), str(scratch), train=TrainOptions(torch.optim.Adam), stream=StreamOptions(max_memory="100MB")
        )
    least = int(re.search(r"the least that works is (\d+) bytes", str(refused.value)).group(1))
    advised = re.search(r"StreamOptions\(max_memory='(\d+MB)'\)", str(refused.value)).group(1)
    grown = torch.ones(4 << 20, dtype=torch.uint8)  # the process grows as it runs (4 MiB, touched)
    with pytest.raises(MemoryBudgetError):  # so the least of before no longer works
        offload_parameters(
            tower(), str(scratch), train=TrainOptions(torch.optim.Adam), stream=StreamOptions(max_memory=least)
        )
    model = tower()
    off = offload_parameters(
        model, str(scratch), train=TrainOptions(torch.optim.Adam), stream=StreamOptions(max_memory=advised)
    )
    model(torch.randn(2, 4)).sum().backward()
    off.step()
    off.close()
    del grown


def test_max_memory_sizes_prefetch_buffers_and_kept_blocks(scratch):
    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import offload_parameters

    model = tower()
    off = offload_parameters(
        model,
        str(scratch),
        train=TrainOptions(optimizer=torch.optim.Adam),
        stream=StreamOptions(prefetch=2, max_memory="64GB"),
    )
    try:
        assert off.plan.prefetch == 2 and off.plan.state_chunks == 6 and off.prefetch == 2
        assert len(off.pinned) == len(off.blocks)  # all blocks fit: kept in memory
        assert off.plan.resident_bytes >= sum(b.nbytes for b in off.blocks)
    finally:
        off.close()


def test_optimizer_of_the_parameters_outside_blocks_gets_buffers_of_its_size(scratch):
    """Its state is tiny next to a block's: buffers of a block's span (pinned where allowed) would be wasted."""
    from torch import nn

    from deepoffload import TrainOptions
    from deepoffload.swap.params import offload_parameters

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), *(nn.Linear(512, 512) if i else nn.Linear(8, 512) for i in range(3)), nn.Linear(512, 2)
    )
    off = offload_parameters(
        model, str(scratch), blocks=list(model)[1:4], train=TrainOptions(optimizer=torch.optim.Adam)
    )
    try:
        model(torch.randn(2, 4)).sum().backward()
        off.step()
        rest = off.optimizers[1].swapper.pool
        assert 0 < rest.held_bytes() <= 6 * max(off.plan.rest_chunk_bytes, 8 << 10), rest.held_bytes()
    finally:
        off.close()


def test_parameters_read_into_their_own_layout_count_in_the_plan(scratch):
    """A channels_last weight is read row-major into the staging buffer and copied into its layout (outside the pool):
    the plan (streaming and max_memory's), a block's bytes in memory and the pinning budget count that copy."""
    from torch import nn

    from deepoffload import StreamOptions, TrainOptions
    from deepoffload.swap.params import offload_parameters

    seen = []

    class Conv(nn.Conv2d):
        def forward(self, x):
            seen.append((self.weight.is_contiguous(memory_format=torch.channels_last), off.store.resident_bytes()))
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(*(Conv(16, 16, 3, padding=1) for _ in range(3)), nn.Flatten(), nn.Linear(256, 2))
    model[:3].to(memory_format=torch.channels_last)
    weight_bytes = model[0].weight.numel() * 4
    x = torch.randn(2, 16, 4, 4).to(memory_format=torch.channels_last)
    for max_memory in (None, "64GB"):
        off = offload_parameters(
            model,
            str(scratch),
            train=TrainOptions(optimizer=torch.optim.SGD),
            stream=StreamOptions(prefetch=1, max_memory=max_memory, max_resident_bytes=0),
        )
        try:
            assert off.plan.layout_bytes == weight_bytes
            assert off.plan.staging_bytes == 3 * (off.plan.block_bytes + weight_bytes)
            block = off.blocks[0]
            assert block.compute_nbytes == weight_bytes and off.blocks[-1].compute_nbytes == 0
            seen.clear()
            model(x).sum().backward()
            assert seen[0][0] and seen[0][1] >= block.nbytes + weight_bytes
            off.step()
            off.set_max_resident_bytes(block.nbytes + weight_bytes - 1)  # its values and their copy do not fit
            assert 0 not in off.pinned
            off.set_max_resident_bytes(block.nbytes + weight_bytes)
            assert 0 in off.pinned
        finally:
            off.close()
