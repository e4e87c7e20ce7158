"""Streamed training in the loops people write around it: accelerate's gradient accumulation, resuming with
load_state_dict, and model changes after offloading."""

from __future__ import annotations

import copy

import pytest
import torch

from deepoffload import LoadOptions, StreamOptions, TrainOptions
from deepoffload.swap.params import offload_parameters
from tests.swap.params.test_params_forward_state import Net, sgd


def test_accelerate_accumulation_in_fused_mode_is_refused_before_any_block_steps(scratch):
    """Fused mode stepped every block inside the first micro-batch's backward; the second backward then raised,
    with the weights already changed by half a step."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=sgd)) as off:
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        model = accelerator.prepare(model)
        try:
            with accelerator.accumulate(model), pytest.raises(RuntimeError, match='accumulate.*mode="grads"'):
                accelerator.backward(model(torch.randn(4, 16)).mean())
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        state = off.state_dict()
    assert all(torch.equal(before[n], state[n]) for n in before)


def _train(model, off, steps, start=0):
    losses = []
    for k in range(start, start + steps):
        torch.manual_seed(50 + k)
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(k))).pow(2).mean()
        loss.backward()
        off.step()
        off.zero_grad()
        losses.append(loss.item())
    return losses


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize(
    "mode, budget, compute_dtype",
    [("fused", None, None), ("grads", "half", None), ("fused", "all", torch.bfloat16), ("grads", None, torch.bfloat16)],
)
def test_load_state_dict_resumes_bit_identically(scratch, mode, budget, compute_dtype):
    """load_state_dict was refused on a streamed model (copy_ on a placeholder), so resuming was impossible; now
    the loaded values go to the blocks' storage (or their masters in memory) and training resumes exactly."""
    from deepoffload.swap.params import StreamedOptimizer

    torch.manual_seed(0)
    initial = Net()
    size = sum(p.numel() * p.element_size() for p in initial.layers.parameters())
    budget = {None: None, "half": size // 2, "all": 3 * size}[budget]

    def setup(folder):
        model = copy.deepcopy(initial)
        off = offload_parameters(
            model,
            str(scratch / folder),
            train=TrainOptions(mode=mode, optimizer=adam),
            stream=StreamOptions(compute_dtype=compute_dtype, max_resident_bytes=budget),
        )
        return model, off

    model, off = setup("whole")
    expected = _train(model, off, 3)
    final = off.state_dict()
    off.close()

    model, off = setup("first")
    _train(model, off, 2)
    saved, saved_optimizer = off.state_dict(), StreamedOptimizer(off).state_dict()
    off.close()
    model, off = setup("resumed")
    with off:
        assert model.load_state_dict(saved) is not None
        StreamedOptimizer(off).load_state_dict(saved_optimizer)
        assert _train(model, off, 1, start=2) == expected[2:]
        state = off.state_dict()
    assert [n for n, t in final.items() if not torch.equal(t, state[n])] == []


def test_load_state_dict_reports_missing_and_mis_shaped_entries_as_in_memory(scratch):
    torch.manual_seed(0)
    model = Net()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as off:
        state = off.state_dict()
        del state["layers.1.0.bias"]
        result = model.load_state_dict(state, strict=False)
        assert result.missing_keys == ["layers.1.0.bias"] and result.unexpected_keys == []
        state["layers.1.0.bias"] = torch.zeros(3)
        with pytest.raises(RuntimeError, match="size mismatch for layers.1.0.bias"):
            model.load_state_dict(state)


def test_served_blocks_refuse_a_load(scratch):
    from deepoffload.formats.writer import save_sharded

    torch.manual_seed(0)
    ref = Net()
    save_sharded({k: v.detach() for k, v in ref.state_dict().items()}, scratch / "ckpt")
    with torch.device("meta"):
        model = Net()
    with offload_parameters(
        model, str(scratch / "swap"), load=LoadOptions(checkpoint=scratch / "ckpt", serve_from_checkpoint=True)
    ):
        with pytest.raises(RuntimeError, match="served read-only.*serve_from_checkpoint"):
            model.load_state_dict(ref.state_dict())


def _refused_next_forward(model, match, *args):
    with pytest.raises(RuntimeError, match=match):
        model(*args)


def test_resize_token_embeddings_after_offloading_is_refused_at_the_next_forward(scratch):
    """The resized head was in no optimizer: never stepped, its gradient piling up, no error."""
    pytest.importorskip("transformers")
    from tests.support.matrix_harness import build

    model = build("llama")
    ids = torch.randint(3, 64, (2, 6))
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)):
        model.resize_token_embeddings(80)
        _refused_next_forward(
            model,
            r"lm_head\.weight.* replaced after offload_parameters\(\).*before "
            r"offload_parameters\(\)",
            ids,
        )


def test_get_peft_model_after_offloading_trains_as_peft_in_memory(scratch):
    """It was refused ("q_proj.weight was moved to ...base_layer.weight"); before that refusal the backward failed.
    Now the adapters are taken (in memory, stepped with the rest) and the frozen base streams from the swap files."""
    peft = pytest.importorskip("peft")
    from tests.support.matrix_harness import build

    def run(model, step, zero_grad):
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
        losses = []
        for k in range(3):
            ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(k))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            step(model)
            zero_grad(model)
            losses.append(loss.item())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    optimizers = {}

    def step(model):
        optimizers.setdefault(0, adam([p for p in model.parameters() if p.requires_grad])).step()

    expected = run(build("llama"), step, lambda model: optimizers[0].zero_grad())
    model = build("llama")
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)) as off:
        losses, adapters = run(model, lambda _: off.step(), lambda _: off.zero_grad())
    assert losses == expected[0]
    assert adapters.keys() == expected[1].keys() and all(torch.equal(v, expected[1][k]) for k, v in adapters.items())


@pytest.mark.parametrize("change", ["replace", "add", "outside"])
def test_modules_changed_after_offloading_are_refused_at_the_next_forward(scratch, change):
    torch.manual_seed(0)
    model = Net()
    with offload_parameters(model, str(scratch), train=TrainOptions(optimizer=adam)):
        if change == "replace":
            model.layers[1][0] = torch.nn.Linear(16, 16)
            match = r"block layers\.1: parameters layers\.1\.0\.weight, layers\.1\.0\.bias were replaced"
        elif change == "add":
            model.layers[2].add_module("extra", torch.nn.Linear(2, 2))
            match = r"block layers\.2: parameters layers\.2\.extra\.weight, layers\.2\.extra\.bias were added"
        else:
            model.add_module("scale", torch.nn.Linear(2, 2))
            match = r"^parameters scale\.weight, scale\.bias were added after offload_parameters"
        _refused_next_forward(model, match, torch.randn(4, 16))


@pytest.mark.parametrize("mode", ["fused", "grads"])
def test_an_in_memory_optimizer_and_scheduler_resume_a_streamed_loop(scratch, mode):
    """A loop of one's own: the state of an optimizer that ran in memory over named parameters, and its scheduler's,
    load into the streamed model's StreamedOptimizer (adapt_scheduler gives the scheduler one entry per streamed
    group), and training continues as it would have in memory. Unnamed state, and settings that one streamed group
    cannot hold, are refused."""
    from deepoffload.errors import CheckpointError
    from deepoffload.swap.params import StreamedOptimizer

    def warmup(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))

    def run(model, optimizer, scheduler, start, steps):
        losses = []
        for k in range(start, start + steps):
            torch.manual_seed(50 + k)
            loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(k))).pow(2).mean()
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(reference.named_parameters(), lr=1e-2)
    scheduler = warmup(optimizer)
    run(reference, optimizer, scheduler, 0, 2)
    saved_optimizer, saved_scheduler = copy.deepcopy(optimizer.state_dict()), scheduler.state_dict()
    model.load_state_dict(reference.state_dict())
    expected = run(reference, optimizer, scheduler, 2, 3)

    with offload_parameters(
        model, str(scratch), train=TrainOptions(mode=mode, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1))
    ) as off:
        streamed = StreamedOptimizer(off)
        streamed_scheduler = warmup(streamed)  # made before loading, as in memory (its first step sets the lr)
        unnamed = copy.deepcopy(saved_optimizer)
        del unnamed["param_groups"][0]["param_names"]
        with pytest.raises(CheckpointError, match=r"named_parameters\(\)"):
            streamed.load_state_dict(unnamed)
        two_groups = copy.deepcopy(saved_optimizer)
        (group,) = two_groups["param_groups"]
        half = len(group["params"]) // 2
        two_groups["param_groups"] = [
            {**group, "params": group["params"][:half], "param_names": group["param_names"][:half]},
            {**group, "params": group["params"][half:], "param_names": group["param_names"][half:], "lr": 0.5},
        ]
        with pytest.raises(CheckpointError, match="group them as the in-memory optimizer did"):
            streamed.load_state_dict(two_groups)
        streamed.load_state_dict(saved_optimizer)
        streamed_scheduler.load_state_dict(saved_scheduler)
        assert len(streamed_scheduler.base_lrs) == 1  # the in-memory run's one group
        streamed.adapt_scheduler(streamed_scheduler)
        assert len(streamed_scheduler.base_lrs) == len(streamed.param_groups) == 2  # the blocks, and the head
        assert run(model, streamed, streamed_scheduler, 2, 3) == expected
        state = off.state_dict()
    assert all(torch.equal(state[n], t) for n, t in reference.state_dict().items())
