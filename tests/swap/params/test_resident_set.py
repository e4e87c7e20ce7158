"""The resident set (``deepoffload/swap/params/blocks/resident_set.py``): ``max_resident_bytes`` keeps the most-run
blocks in memory. In an encoder-decoder ``generate`` (the encoder runs once, the decoder once per token) the decoder's
blocks end up kept, so a token reads nothing and ``stats.bytes_read`` drops; the tokens stay those of the model in
memory. Blocks run equally often (a decoder-only model) keep the first blocks first and never change."""

from __future__ import annotations

import pytest
import torch

from deepoffload import StreamOptions
from deepoffload.swap.params import offload_parameters
from deepoffload.swap.params.blocks.resident_set import MARGIN, ResidentSet

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class Sized:
    def __init__(self, index: int, nbytes: int):
        self.index, self.nbytes, self.compute_nbytes = index, nbytes, 0


def test_ties_keep_the_first_blocks_and_equal_runs_never_change_the_set():
    blocks = [Sized(i, 100) for i in range(6)]
    chosen = ResidentSet(6)
    assert [b.index for b in chosen.choose(blocks, 250)] == [0, 1]
    for _token in range(5):  # a decoder-only model: every block once per token, asked before each block runs
        for block in blocks:
            chosen.count(block.index)
            assert not chosen.stale(blocks, 250, {0, 1})


def test_blocks_run_more_often_replace_those_kept_once_they_lead_by_the_margin():
    blocks = [Sized(i, 100) for i in range(4)]
    chosen = ResidentSet(4)
    for i in range(4):
        chosen.count(i)  # the encoder (0, 1) and the first decoder pass (2, 3)
    assert not chosen.stale(blocks, 200, {0, 1})
    for _ in range(MARGIN):
        chosen.count(2)
        chosen.count(3)
    assert chosen.stale(blocks, 200, {0, 1})
    assert [b.index for b in chosen.choose(blocks, 200)] == [2, 3]
    assert not chosen.stale(blocks, 0, set())  # no budget, nothing to keep


def t5_config():
    return transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def test_an_encoder_decoder_generate_keeps_the_decoder_and_reads_fewer_bytes(scratch):
    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(t5_config()).eval()
    ids = torch.randint(2, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(ids, **settings)
    model = transformers.T5ForConditionalGeneration(t5_config()).eval()
    model.load_state_dict(reference.state_dict())
    decoder_bytes = sum(p.numel() * 4 for p in model.decoder.block.parameters())
    # room for the decoder, not for more; prefetch 0: no block is read ahead (after the last decoder block the
    # schedule would read the first block, the encoder's, ahead of a next token), so the reads are the blocks run
    stream = StreamOptions(max_resident_bytes=decoder_bytes + 100, prefetch=0)
    with offload_parameters(model, str(scratch), stream=stream) as off, torch.no_grad():
        decoder = {i for i, b in enumerate(off.blocks) if b.prefix.startswith("decoder.")}
        assert off.pinned != decoder  # before anything ran: the first blocks (the encoder's) first
        reads = []
        for _ in range(2):
            before = off.stats.bytes_read
            assert torch.equal(model.generate(ids, **settings), expected)
            reads.append(off.stats.bytes_read - before)
        assert off.pinned == decoder
        encoder_bytes = sum(b.nbytes for b in off.blocks if b.index not in decoder)
        # the second generate reads the encoder once and the decoder never
        assert reads[1] < reads[0]
        assert reads[1] <= encoder_bytes + 4096 * len(off.blocks)
