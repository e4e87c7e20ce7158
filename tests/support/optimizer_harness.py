"""The optimizer's differential matrix: one tiny model (two param groups, a layer whose parameters get no gradient
in odd steps) trained twice on the same batches, with the plain optimizer in memory and with ``OffloadedOptimizer``,
for each combination of optimizer x size x what the loop does between backward and ``step()`` x ``step_in_backward``
or not. A cell's outcome:

- ``identical``: losses, parameters and optimizer state (``state_dict()``) bit-identical to the in-memory run;
- ``refused``: deepoffload raised one of its errors before any parameter changed, naming what to use instead;
- anything else (``differs``, ``refused late``, ``error``) is a defect.

``expected(cell)`` says which of the first two each cell must give. ``run_loop`` takes any sequence of per-step
actions, which the property-based test draws at random.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from deepoffload import OffloadedOptimizer, SwapConfig
from deepoffload.errors import DeepOffloadError

OPTIMIZERS = ("adam", "sgd", "per_param", "cross_param", "undeclared")
SIZES = ("one_chunk", "many_chunks", "sliced")
BETWEEN = ("nothing", "clip", "scaler", "inplace", "data", "reassign")
MODES = ("step", "in_backward")
STEPS = 4
CHUNK_BYTES = {"one_chunk": 32 << 20, "many_chunks": 4096, "sliced": 4096}  # many: about a parameter's state a chunk
# "sliced": torch's Adam steps each parameter of over 7 elements in slices (``adam_slices``: of 256 elements, the
# least it cuts), on a model wide enough to have them (64 x 64 weights: 16 slices each)
SLICE_ELEMENTS = {"sliced": 7}
WIDTH = {"sliced": 64}


def offloaded(name: str, param_groups: list[dict], config: SwapConfig, size: str) -> OffloadedOptimizer:
    """The offloaded optimizer of a cell: optimizer ``name`` over ``param_groups``, sliced as ``size`` says."""
    opt = OffloadedOptimizer(MAKERS[name], param_groups, config)
    if size in SLICE_ELEMENTS:
        opt.pipeline.slice_elements = SLICE_ELEMENTS[size]
    return opt


class PerParamSGD(torch.optim.Optimizer):
    """Hand-written SGD with a momentum and a step count per parameter: reads each parameter alone."""

    deepoffload_per_parameter = True

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = torch.zeros((), dtype=torch.int64)
                    state["momentum"] = torch.zeros_like(p)
                state["count"] += 1
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """Hand-written SGD on gradients divided by their global norm: one step reads every parameter's gradient."""

    deepoffload_per_parameter = False

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) + 1e-6
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state["momentum"] = torch.zeros_like(p)
                    state["momentum"].mul_(0.9).add_(p.grad / norm)
                    p.add_(state["momentum"], alpha=-group["lr"])


class Undeclared(GlobalNormSGD):
    """The same, without saying how its step reads parameters."""

    deepoffload_per_parameter = None  # type: ignore[assignment]


MAKERS: dict[str, Callable] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "per_param": PerParamSGD,
    "cross_param": GlobalNormSGD,
    "undeclared": Undeclared,
}


class Model(torch.nn.Module):
    """Tanh layers and a side layer used only in even steps (its parameters get no gradient in odd steps)."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.body = torch.nn.Sequential(*layers)
        self.side = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1)
        self.calls = 0

    def forward(self, x):
        x = self.body(x)
        if self.calls % 2 == 0:
            x = x + self.side(x)
        self.calls += 1
        return self.head(x)


def model(width: int = 8, depth: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return Model(width, depth)


def groups(module: torch.nn.Module) -> list[dict]:
    """Two param groups: the head with its own learning rate."""
    head = set(map(id, module.head.parameters()))
    return [
        {"params": [p for p in module.parameters() if id(p) not in head]},
        {"params": list(module.head.parameters()), "lr": 0.02},
    ]


def data(k: int, width: int) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(k))


def between(action: str, module: torch.nn.Module) -> None:
    """Change the gradients after backward as ``action`` says ("scaler" is done by the loop)."""
    params = [p for p in module.parameters() if p.grad is not None]
    if action == "clip":
        torch.nn.utils.clip_grad_norm_(params, 0.05)
    elif action == "inplace":
        for p in params:
            p.grad.mul_(0.5)
    elif action == "data":
        for p in params:
            p.grad.data.mul_(0.5)
    elif action == "reassign":
        for p in params:
            p.grad = p.grad * 0.5


@dataclass
class Trace:
    losses: list[float]
    refused: int | None = None  # the step whose call raised deepoffload's refusal
    error: BaseException | None = None
    moved_before_refusal: bool = False  # parameters differed from the last completed step's at the refusal


def run_loop(
    module, optimizer, actions: Sequence[str], width: int, scaled: bool | None = None, overflow_at: int | None = 1
) -> Trace:
    """Train one step per action; a scaler (``scaled``, by default when an action is "scaler") scales every loss,
    and step ``overflow_at`` overflows (the scaler skips it)."""
    scaled = "scaler" in actions if scaled is None else scaled
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2) if scaled else None
    trace = Trace([])
    for k, action in enumerate(actions):
        last = [p.detach().clone() for p in module.parameters()]
        try:
            loss = module(data(k, width)).square().mean()
            if scaler is not None and k == overflow_at:
                loss = loss * 1e38 * 1e38  # inf
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            else:
                loss.backward()
            between(action, module)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
        except DeepOffloadError as e:
            trace.refused, trace.error = k, e
            trace.moved_before_refusal = not all(torch.equal(a, b) for a, b in zip(last, module.parameters()))
            return trace
        trace.losses.append(loss.item())
    return trace


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if x.keys() != y.keys():
            return False
        for name in x:
            u, v = x[name], y[name]
            if isinstance(u, torch.Tensor) != isinstance(v, torch.Tensor):
                return False
            if isinstance(u, torch.Tensor) and not (u.dtype == v.dtype and torch.equal(u, v)):
                return False
            if not isinstance(u, torch.Tensor) and u != v:
                return False
    return True


@dataclass
class Outcome:
    status: str
    detail: str = ""


def compare(name: str, size: str, actions: Sequence[str], mode: str, folder: str, width: int = 8) -> Outcome:
    """Run the in-memory and the offloaded loop and classify the result."""
    reference = model(width)
    ref_opt = MAKERS[name](groups(reference))
    expected = run_loop(reference, ref_opt, actions, width)
    if expected.error is not None:
        return Outcome("error", f"in memory: {expected.error!r}")
    module = model(width)
    initial = [p.detach().clone() for p in module.parameters()]
    config = SwapConfig(folder=folder, chunk_bytes=CHUNK_BYTES[size], buffer_count=4, pin=False)
    try:
        opt = offloaded(name, groups(module), config, size)
    except DeepOffloadError as e:
        return Outcome("refused", f"at construction: {e}")
    try:
        if mode == "in_backward":
            try:
                opt.step_in_backward()
            except DeepOffloadError as e:
                return Outcome("refused", f"at step_in_backward(): {e}")
        got = run_loop(module, opt, actions, width)
        if got.error is not None:
            untouched = all(torch.equal(a, b) for a, b in zip(initial, module.parameters()))
            if got.refused == 0 and untouched:
                return Outcome("refused", str(got.error))
            return Outcome("refused late", f"step {got.refused}: {got.error}")
        same = got.losses == expected.losses and all(
            torch.equal(a, b) for a, b in zip(reference.parameters(), module.parameters())
        )
        same = same and _same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
        return Outcome("identical" if same else "differs", f"{got.losses} vs {expected.losses}")
    finally:
        opt.close()


def expected(name: str, size: str, action: str, mode: str) -> str:
    """What a cell must give (see the module docstring)."""
    if name == "undeclared":
        return "refused"  # not known to read each parameter alone
    if mode == "in_backward" and (name == "cross_param" or action != "nothing"):
        return "refused"  # needs every gradient / changes the gradients backward already used
    return "identical"


def run_cell(name: str, size: str, action: str, mode: str) -> Outcome:
    with tempfile.TemporaryDirectory() as folder:
        return compare(name, size, [action] * STEPS, mode, folder, width=WIDTH.get(size, 8))
