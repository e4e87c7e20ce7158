"""Parameter offload, inference: outputs bit-identical to the in-memory model for a small transformer at prefetch
0/1/2, the default block rule and explicit blocks, resident bytes bounded by (prefetch + 2) blocks, memory really
released (RSS), checkpoints and restoring."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from deepoffload import StreamOptions
from deepoffload.swap.params import Residency, find_blocks, offload_parameters
from tests.support.models import ModelSize, SyntheticText, build_model

SIZE = ModelSize(vocab=64, width=32, layers=5, heads=2, context=16, batch=3)


def tokens(seed: int = 0) -> torch.Tensor:
    return SyntheticText(SIZE, seed).batch()[:, :-1]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("train_mode", [False, True], ids=["eval", "train"])
def test_outputs_identical_to_in_memory(scratch, prefetch, train_mode):
    reference, model = build_model(SIZE), build_model(SIZE)
    reference.train(train_mode), model.train(train_mode)
    offload = offload_parameters(model, str(scratch), stream=StreamOptions(prefetch=prefetch))
    try:
        assert [b.prefix for b in offload.blocks] == [f"blocks.layers.{i}" for i in range(SIZE.layers)]
        block_bytes = offload.stats.block_bytes
        assert offload.stats.resident_bytes == 0
        assert all(b.state is Residency.ON_STORAGE for b in offload.blocks)
        offload.reset_peak()
        with torch.no_grad():
            for seed in range(3):  # later passes start from blocks prefetched at the end of the previous one
                assert torch.equal(model(tokens(seed)), reference(tokens(seed)))
        stats = offload.stats
        assert block_bytes <= stats.peak_bytes <= (prefetch + 2) * block_bytes
        assert stats.bytes_read >= 3 * SIZE.layers * block_bytes
        assert stats.resident_bytes <= prefetch * block_bytes  # only the next pass's first blocks
    finally:
        offload.close(restore=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():
        assert torch.equal(model(tokens()), reference(tokens()))  # unhooked: the plain module again


def test_explicit_blocks_and_sequential_module(scratch):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model.load_state_dict(reference.state_dict())
    assert [name for name, _ in find_blocks(model)] == ["0", "2", "4"]  # children without parameters are skipped
    x = torch.randn(5, 8)
    with offload_parameters(model, str(scratch), blocks=[model[2], model[4]]) as offload:
        assert [b.prefix for b in offload.blocks] == ["2", "4"]
        assert model[0].weight.numel() == 8 * 16  # not a block: stays in memory
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        state = offload.state_dict()
        assert state.keys() == reference.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_compute_dtype_inference_matches_the_same_casts_in_memory(scratch):
    reference, model = build_model(SIZE), build_model(SIZE)
    reference.blocks.to(torch.bfloat16)
    for module in (reference, model):  # the rest of the model computes in bf16 too, so the blocks get bf16 inputs
        for name in ("embed", "norm", "head"):
            getattr(module, name).to(torch.bfloat16)
        module.position.data = module.position.data.to(torch.bfloat16)
    with offload_parameters(model, str(scratch), stream=StreamOptions(compute_dtype=torch.bfloat16)) as offload:
        assert offload.blocks[0].masters[0].dtype == torch.float32  # on storage: the fp32 master weights
        with torch.no_grad():
            assert torch.equal(model(tokens()), reference(tokens()))
        assert offload.stats.block_bytes == 6 * sum(p.numel() for p in reference.blocks.layers[0].parameters())


RSS_CHILD = """
import gc, sys, threading
import torch
from torch import nn
from deepoffload import StreamOptions
from deepoffload.swap.params import offload_parameters

def rss_bytes():  # anonymous memory: the weights; not the code pages a first use maps in (CPU and page cache)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

torch.manual_seed(0)
blocks, width = 8, 1024  # 8 blocks of 8 MiB
model = nn.Sequential(*[nn.Linear(width, 2 * width, bias=False) if i % 2 == 0 else
                        nn.Linear(2 * width, width, bias=False) for i in range(blocks)])
model_bytes = sum(p.numel() * 4 for p in model.parameters())
x = torch.randn(4, width)
with torch.no_grad():
    expected = model(x)
gc.collect()
before = rss_bytes()
offload = offload_parameters(model, sys.argv[1], stream=StreamOptions(prefetch=1))
gc.collect()
after = rss_bytes()
peak = after
stop = threading.Event()
def sample():
    global peak
    while not stop.wait(0.001):
        peak = max(peak, rss_bytes())
sampler = threading.Thread(target=sample)
sampler.start()
with torch.no_grad():
    out = model(x)
stop.set()
sampler.join()
print(model_bytes, before - after, peak - after, offload.stats.block_bytes, offload.stats.peak_bytes,
      bool(torch.equal(out, expected)))
offload.close()
"""


def test_rss_falls_with_offload_and_stays_bounded_while_streaming(scratch):
    """In a fresh process: RSS depends on what the allocator kept from earlier tests (glibc raises its mmap
    threshold after large frees and then keeps freed memory), which this test must not inherit."""
    proc = subprocess.run([sys.executable, "-c", RSS_CHILD, str(scratch)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    model_bytes, fell, grew, block_bytes, peak_bytes, equal = proc.stdout.split()
    model_bytes, fell, grew, block_bytes, peak_bytes = map(int, (model_bytes, fell, grew, block_bytes, peak_bytes))
    assert equal == "True"
    assert fell > 0.6 * model_bytes, f"RSS fell by {fell} of {model_bytes} bytes"
    limit = 3 * block_bytes + (8 << 20)  # prefetch + 2 blocks, plus slack for the allocator
    assert grew < limit, f"RSS grew by {grew} bytes while streaming (limit {limit})"
    assert peak_bytes <= 3 * block_bytes
