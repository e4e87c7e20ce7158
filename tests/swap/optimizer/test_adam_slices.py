"""torch's Adam and AdamW stepped over slices of each large parameter (``adam_slices``): the same bits as the whole
step at odd sizes, three dtypes and 1-4 threads (slices cut anywhere else differ: bf16 at two threads); the step count
written back in place once; the slices' entries gone after the step, also when it raises; what cannot be split
stepped whole; a calibration that finds other bits turns slicing off. The optimizer's differential matrix has a
"sliced" size too (``tests/support/optimizer_harness.py``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepoffload.swap.adam_slices as adam_slices_module
import deepoffload.swap.optimizer_pipeline as optimizer_pipeline
from deepoffload.errors import UnsupportedError
from deepoffload.swap.adam_slices import GRAIN, SLICE_ELEMENTS, UNIT, adam_slices, pieces, sliceable, thread_ranges
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.torch_optim import intra_op_threads

ELEMENTS = 1 << 17  # the slice length the tests ask for (the default, 4M elements, would make them slow)
ODD = ELEMENTS * 3 + 5  # past three slices, not a multiple of the vector width
MAKERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "adam_tensor_lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3), maximize=True, weight_decay=0.1),
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaNs compare equal to themselves)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _params(dtype=torch.float32, shapes=((ODD,), (513, 1031), (100,))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


def _grads(params, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        # magnitudes from 1e-30 to 1e2: denormal squares, and overflow to inf in fp16
        scale = 10.0 ** torch.randint(-30, 3, p.shape, generator=g).float()
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def _stepped_once() -> tuple[list[torch.nn.Parameter], torch.optim.Adam]:
    """The test parameters and an Adam over them after its first step (which makes the state, whole)."""
    params = _params()
    opt = torch.optim.Adam(params, lr=1e-3)
    _grads(params, 0)
    opt.step()
    return params, opt


class Counter:
    """Wraps ``adam_slices`` as the pipeline calls it and counts the tensors each step gives the optimizer."""

    def __init__(self, monkeypatch):
        self.given: list[int] = []
        monkeypatch.setattr(optimizer_pipeline, "adam_slices", self)

    @contextlib.contextmanager
    def __call__(self, *args, **kwargs):
        with adam_slices(*args, **kwargs) as groups:
            self.given.append(sum(map(len, groups)))
            yield groups


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_slices_give_the_bits_of_the_whole_step(scratch, monkeypatch, name, threads, dtype):
    counter = Counter(monkeypatch)
    reference, params = _params(dtype), _params(dtype)
    ref_opt = MAKERS[name](reference)
    config = SwapConfig(folder=str(scratch), pin=False)
    with intra_op_threads(threads), OffloadedOptimizer(MAKERS[name], params, config) as opt:
        assert opt.pipeline.slice_elements == SLICE_ELEMENTS
        opt.pipeline.slice_elements = ELEMENTS
        for k in range(3):
            for group in (reference, params):
                _grads(group, k)
            ref_opt.step()
            opt.step()
        for a, b in zip(reference, params):
            assert torch.equal(bits(a), bits(b))
        got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        for i in want:
            assert got[i].keys() == want[i].keys()
            for key in want[i]:
                assert torch.equal(bits(got[i][key]), bits(want[i][key])), (i, key)
        sliced = sum(len(pieces(p.numel(), ELEMENTS, threads)) for p in params[:2]) + 1
    assert sliced > 4  # the two large parameters are cut
    assert counter.given == [3, sliced, sliced]  # the first step makes the state, whole


def _cut_anywhere() -> pytest.MonkeyPatch:
    """Slices from each parameter's start, ignoring torch's thread ranges (what ``pieces`` avoids)."""
    monkey = pytest.MonkeyPatch()
    monkey.setattr(adam_slices_module, "pieces", lambda n, e, t: [(a, min(a + e, n)) for a in range(0, n, e)])
    return monkey


def test_slices_cut_without_the_thread_ranges_differ_which_is_why_they_follow_them():
    def outcome(cut: str) -> list[torch.Tensor]:
        params = _params(torch.bfloat16, shapes=((513, 1031),))  # two threads: ranges of 264452 and 264451
        opt = MAKERS["adam_tensor_lr"](params)
        for k in range(3):
            _grads(params, k)
            if cut == "whole" or k == 0:
                opt.step()
                continue
            monkey = _cut_anywhere() if cut == "anywhere" else None
            try:
                with adam_slices_module._sliced(opt, [params], ELEMENTS) as groups:
                    opt.param_groups[0]["params"] = groups[0]
                    opt.step()
            finally:
                opt.param_groups[0]["params"] = params
                if monkey is not None:
                    monkey.undo()
        return [bits(t).clone() for t in (params[0].detach(), *opt.state[params[0]].values())]

    with intra_op_threads(2):
        whole, followed, anywhere = outcome("whole"), outcome("pieces"), outcome("anywhere")
    assert all(torch.equal(a, b) for a, b in zip(whole, followed))
    assert not all(torch.equal(a, b) for a, b in zip(whole, anywhere))


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(1, 12 * GRAIN),
    elements=st.sampled_from([7, UNIT, 1000, GRAIN, 3 * GRAIN + 1, ELEMENTS, SLICE_ELEMENTS]),
    threads=st.integers(1, 16),
)
def test_pieces_keep_every_element_on_the_whole_steps_code(numel, elements, threads):
    cuts = pieces(numel, elements, threads)
    assert cuts[0][0] == 0 and cuts[-1][1] == numel
    assert all(a < b for a, b in cuts) and all(x[1] == y[0] for x, y in zip(cuts, cuts[1:]))
    if cuts == [(0, numel)]:
        return
    ranges = thread_ranges(numel, threads)
    for start, end in cuts:
        r0, r1 = next(r for r in ranges if r[0] <= start < r[1])
        assert end <= r1  # never across two threads' ranges
        assert (start - r0) % UNIT == 0  # vector groups start where the whole step's do
        length = end - start
        if threads > 1 and length >= GRAIN:  # torch splits it: each thread a multiple of UNIT, or up to the end
            assert all(a % UNIT == 0 for a, _ in thread_ranges(length, threads))
        assert end == r1 or length % UNIT == 0  # all vector, or up to the range's end (its scalar tail)


def test_the_step_count_is_written_back_in_place_once():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-3)
    _grads(params, 0)
    opt.step()
    steps = [opt.state[p]["step"] for p in params]
    _grads(params, 1)
    with adam_slices(opt, [params], ELEMENTS) as groups:
        assert len(groups[0]) > 3
        assert all(piece.grad is not None for piece in groups[0])
        opt.param_groups[0]["params"], saved = groups[0], opt.param_groups[0]["params"]
        opt.step()
        opt.param_groups[0]["params"] = saved
    assert all(opt.state[p]["step"] is s for p, s in zip(params, steps))  # the same tensors
    assert all(s.item() == 2.0 for s in steps)
    assert len(opt.state) == 3  # the slices' entries are gone


def test_the_slices_leave_when_the_step_raises():
    params, opt = _stepped_once()
    with pytest.raises(ZeroDivisionError):
        with adam_slices(opt, [params], ELEMENTS) as groups:
            pieces_ = groups[0]
            raise ZeroDivisionError
    assert len(opt.state) == 3
    assert all(piece.grad is None for piece in pieces_ if not any(piece is p for p in params))
    assert all(opt.state[p]["step"].item() == 1.0 for p in params)  # not advanced by a step that failed


def test_a_replaced_state_tensor_is_an_error():
    params, opt = _stepped_once()
    with pytest.raises(UnsupportedError, match="slice_elements = None"):
        with adam_slices(opt, [params], ELEMENTS) as groups:
            opt.state[groups[0][0]]["exp_avg"] = torch.zeros(1)


def test_a_slice_changed_in_place_counts_as_a_change_of_its_parameter():
    params, opt = _stepped_once()
    before = params[0]._version
    with adam_slices(opt, [params], ELEMENTS) as groups:
        groups[0][0].add_(0)
    assert params[0]._version > before  # autograd's check of saved tensors still sees it


def test_a_calibration_that_finds_other_bits_steps_every_parameter_whole(monkeypatch):
    monkeypatch.setattr(adam_slices_module, "_calibration", {})
    original = adam_slices_module._sliced

    @contextlib.contextmanager
    def off_by_one(optimizer, groups, elements):  # a torch that splits work otherwise: the trial's bits differ
        with original(optimizer, groups, elements) as chosen:
            yield chosen
            for piece in chosen[0]:
                piece.add_(1)

    monkeypatch.setattr(adam_slices_module, "_sliced", off_by_one)
    params, opt = _stepped_once()
    with pytest.warns(RuntimeWarning, match="each parameter steps whole"):
        with adam_slices(opt, [params], ELEMENTS) as groups:
            assert len(groups[0]) == 3


@pytest.mark.parametrize(
    "case",
    ["first_step", "no_grad", "fused", "foreach", "subclass", "non_contiguous", "small", "other_state_key", "off"],
)
def test_what_cannot_be_split_steps_whole(case):
    params = _params()
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(case, {})
    cls = type("MyAdam", (torch.optim.Adam,), {}) if case == "subclass" else torch.optim.Adam
    opt = cls(params, lr=1e-3, **options)
    _grads(params, 0)
    if case != "first_step":
        opt.step()
    if case == "no_grad":
        params[0].grad = None
    if case == "non_contiguous":
        params[1].grad = params[1].grad.t().contiguous().t()
    if case == "other_state_key":
        opt.state[params[0]]["other"] = torch.zeros(1)
    elements = {"small": params[0].numel(), "off": 0}.get(case, ELEMENTS)
    with intra_op_threads(2), adam_slices(opt, [params], elements=elements) as groups:
        given = groups[0]
    cut = [len(pieces(p.numel(), ELEMENTS, 2)) for p in params]
    whole = {
        "no_grad": 1 + cut[1] + 1,
        "non_contiguous": cut[0] + 1 + 1,
        "other_state_key": 1 + cut[1] + 1,
    }.get(case, 3)
    assert sliceable(opt) == (case != "subclass")
    assert len(given) == whole


PEAK = """
import sys, torch
from deepoffload.errors import UnsupportedError
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
torch.manual_seed(0)
emb = torch.nn.Embedding(131072, 512)  # 64M elements: 256 MiB
opt = OffloadedOptimizer(torch.optim.Adam, emb.parameters(), SwapConfig(folder=sys.argv[1], pin=False), lr=1e-3)
if sys.argv[2] == "whole":
    opt.pipeline.slice_elements = None
def kib(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])
growth = []
for step in range(3):
    emb(torch.randint(0, 131072, (64, 16))).square().mean().backward()
    if step:  # the first step makes the state in memory, whole
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory starts again from here
    before = kib("VmRSS:")
    opt.step()
    if step:
        growth.append(kib("VmHWM:") - before)
    opt.zero_grad()
opt.close()
print(max(growth) // 1024)
"""


@pytest.mark.slow
def test_a_sliced_step_over_a_large_parameter_holds_no_temporaries_of_its_size(scratch):
    import subprocess
    import sys

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"the peak resident memory cannot be reset here: {e}")
    growth = {}
    for mode in ("whole", "sliced"):
        run = subprocess.run([sys.executable, "-c", PEAK, str(scratch), mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        growth[mode] = int(run.stdout.split()[-1])  # MiB the step's peak rose above the resident memory before it
    # whole: torch's two temporaries of the embedding's 256 MiB; sliced: those of a slice (4 MiB each), the previous
    # slice's denominator, which torch's loop keeps until the next one replaces it, and the heap's slack (13-35 MiB
    # seen), whatever the parameter's size
    assert growth["whole"] >= 400, growth
    assert growth["sliced"] <= 96, growth
