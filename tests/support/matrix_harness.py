"""The differential matrix: one model trained twice on the same batches and seeds, in memory and with deepoffload,
for each combination of model, precision, training loop and deepoffload feature. A cell's outcome:

- ``identical``: losses, parameters (and buffers) and optimizer state bit-identical to the in-memory run;
- ``refused``: deepoffload raised before any parameter changed, with a message naming what to use instead;
- ``rounding``: equal within rounding (``ROUNDING`` says for which models and why; checked with a tolerance);
- ``not exact``: for those models only, the same cause amplified beyond rounding (a known limitation);
- ``in-memory fails too``: the loop itself refuses the combination without deepoffload (e.g. fp16 on a CPU);
- anything else (``differs``, ``refused late``, ``error``) is a defect.

``python tests/support/matrix_harness.py [--write docs/support-matrix.md]`` runs every cell and writes the support
matrix (see ``main`` for running it in parts).
Tiny models built from configs (no downloads), 3 steps each."""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from deepoffload import trainer_arguments
from deepoffload.swap.config import SwapConfig
from deepoffload.swap.optimizer import OffloadedOptimizer
from deepoffload.swap.params import StreamedOptimizer, find_blocks, offload_parameters
from deepoffload.swap.params.options import LoadOptions, StreamOptions, TrainOptions

MODELS = ("llama", "gpt2", "t5", "mixtral", "plain", "qwen2_moe", "deepseek_v3")
PRECISIONS = ("fp32", "bf16", "fp16", "compute_bf16")
LOOPS = ("plain", "trainer", "accelerate", "lora", "lora_served")
FEATURES = (
    "optimizer",
    "fused",
    "grads",
    "half",
    "serve",
    "codec",
    "two_folders",
    "activations",
    "storage_cache",
    "kept_graph",
)
STEPS = 3
LR = 1e-2
LORA_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "t5": ["q", "v"],
    "mixtral": ["q_proj", "v_proj"],
    "plain": ["fc"],
    "qwen2_moe": ["q_proj", "v_proj"],
    "deepseek_v3": ["q_proj", "o_proj"],
}


# -- models -----------------------------------------------------------------------------------------------------
class PlainBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2)))


class PlainModel(nn.Module):
    """A plain torch model with BatchNorm and dropout, called like a Hugging Face causal LM (input_ids, labels)."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(PlainBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None, **_):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def build(name: str, device: str | None = None) -> nn.Module:
    """The tiny model ``name`` (random weights from seed 0; on ``device`` "meta": built without memory)."""
    import transformers as T

    moe_model = importlib.import_module("tests.support.moe_models" if __package__ else "moe_models").moe_model

    small = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    makers: dict[str, Callable[[], nn.Module]] = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**small)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "t5": lambda: T.T5ForConditionalGeneration(
            T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
        ),
        "mixtral": lambda: moe_model("mixtral", small, experts=4),
        "plain": PlainModel,
        "qwen2_moe": lambda: moe_model("qwen2_moe", small, experts=4),
        "deepseek_v3": lambda: moe_model("deepseek_v3", small, experts=4),  # shared experts; MLA attention
    }
    torch.manual_seed(0)
    with torch.device(device) if device else contextlib.nullcontext():
        return makers[name]()


def batch(name: str, k: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(10 + k))
    return {"input_ids": ids, "labels": ids[:, :6].contiguous() if name == "t5" else ids}


def loss_of(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output.loss


# -- the two runs -----------------------------------------------------------------------------------------------
@dataclass
class Run:
    losses: list[float]
    state: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]  # per parameter name: its optimizer state


class Setup:
    """The model and the optimizer a loop trains (for deepoffload: offloaded as ``feature`` asks)."""

    def __init__(self, name: str, precision: str, loop: str, feature: str | None, folder: Path):
        self.name, self.precision, self.loop, self.feature, self.folder = name, precision, loop, feature, folder
        folder.mkdir(parents=True, exist_ok=True)  # (deepoffload makes the last part of a swap path only)
        self.off = None
        model = build(name)
        # LoRA over a served base, after offloading (the in-memory columns put LoRA on the in-memory model first)
        lora_after = loop == "lora_served" and feature not in (None, "activations", "storage_cache")
        if loop == "lora_served" and feature in ("optimizer", "serve"):
            raise NotApplicable("lora_served serves the base from its checkpoint in every training column")
        if feature == "kept_graph" and loop != "lora_served":
            raise NotApplicable("recompute=False changes blocks with no trainable parameter: lora_served's frozen base")
        if loop in ("lora", "lora_served") and feature != "serve" and not lora_after:
            model = _lora(model, name)
        self.model = model.train()
        if feature in (None, "activations"):  # (activations: this in-memory model, under offload_activations)
            self.model = model if precision != "compute_bf16" else _compute_bf16_in_memory(model)
            self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        elif feature == "optimizer":
            if precision == "compute_bf16":
                raise NotApplicable("compute_dtype= is an offload_parameters() option (StreamOptions)")
            self.optimizer = OffloadedOptimizer(
                torch.optim.AdamW,
                [p for p in model.parameters() if p.requires_grad],
                SwapConfig(folder=str(folder)),
                lr=LR,
            )
        else:
            train = TrainOptions(
                lambda ps: torch.optim.AdamW(ps, lr=LR),
                mode="fused" if feature in ("fused", "two_folders") else "grads",
            )
            stream = StreamOptions(
                compute_dtype=torch.bfloat16 if precision == "compute_bf16" else None,
                recompute=feature != "kept_graph",  # frozen blocks keep their forward's graph for backward
            )
            load = None
            if feature == "half":
                blocks = find_blocks(model)
                size = sum(p.numel() * p.element_size() for _, b in blocks for p in b.parameters())
                stream = stream.replace(max_resident_bytes=size // 2 * (3 if precision == "compute_bf16" else 2) // 2)
            if feature == "serve" or lora_after:
                model = self.model = self._served(model)
                load = LoadOptions(checkpoint=folder / "ckpt", serve_from_checkpoint=True, init=_init_of(model))
            config = SwapConfig(codec="lossless") if feature == "codec" else None
            path = _two_drives(self) if feature == "two_folders" else str(folder / "swap")  # fused, over two drives
            try:
                self.off = offload_parameters(model, path, train=train, load=load, stream=stream, config=config)
            except BaseException:
                self.close()  # (the drives too)
                raise
            if (
                loop == "lora" and feature == "serve"
            ) or lora_after:  # a served model exists only offloaded: LoRA after
                self.model = _lora(model, name)
            self.optimizer = StreamedOptimizer(
                self.off, clip_grad_norm=1.0 if loop == "accelerate" and self.off.mode == "grads" else None
            )

    def _served(self, model: nn.Module) -> nn.Module:
        """The same model built on meta, to load from a safetensors checkpoint of ``model`` and serve from it."""
        from deepoffload.formats.writer import save_sharded

        seen, state = set(), {}
        for key, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                state[key] = tensor.detach()
        save_sharded(state, self.folder / "ckpt", max_shard_bytes=10**9)
        return build(self.name, "meta").train()

    def close(self) -> None:
        if self.off is not None:
            self.off.close(restore=False)
        elif isinstance(getattr(self, "optimizer", None), OffloadedOptimizer):  # (set up may fail before it)
            self.optimizer.close()  # type: ignore[union-attr]
        if getattr(self, "drives", None) is not None:
            self.drives.__exit__(None, None, None)

    # -- results ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        if self.off is not None:
            self.off.flush()  # (then the model's own state_dict: a PEFT model around the offloaded one has its names)
        source = self.model.state_dict()
        return {k: v.detach().clone() for k, v in source.items()}

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        if self.off is not None:
            by_id = {id(p): n for n, p in self.model.named_parameters()}  # (a PEFT model around it: its names)
            named = {id(m): b.qualified(n) for b in self.off.blocks for n, m in zip(b.names, b.masters)}
            named.update({id(p): by_id.get(id(p), n) for n, p in self.off.rest_named})
            optimizers = self.off.optimizers  # the blocks', then the rest's: each made when it has parameters to step
            names = [[named[id(p)] for g in o.param_groups for p in g["params"]] for o in optimizers]
        else:
            by_id = {id(p): n for n, p in self.model.named_parameters()}
            optimizers = [self.optimizer]
            names = [[by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]]
        out = {}
        for optimizer, ns in zip(optimizers, names):
            sd = optimizer.state_dict()
            order = [i for g in sd["param_groups"] for i in g["params"]]
            for index, name in zip(order, ns):
                if index in sd["state"]:
                    out[name] = {
                        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["state"][index].items()
                    }
        return out


def _lora(model: nn.Module, name: str) -> nn.Module:
    import peft

    torch.manual_seed(1)  # (the adapters' initial values: the same in memory and offloaded)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=LORA_TARGETS[name], lora_dropout=0.1))


def _two_drives(setup: Setup) -> list[str]:
    """Two tmpfs mounts (distinct devices: ``tests/support/drives.py``, root only), unmounted at ``setup.close()``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (run as a script: the repository's tests/)
    from tests.support.drives import Drives, unavailable

    reason = unavailable("tmpfs")
    if reason is not None:
        raise NotApplicable(f"two drives: {reason}")
    setup.drives = Drives(2, size=256 << 20, kind="tmpfs").__enter__()
    return setup.drives.folders


class NotApplicable(Exception):
    """The combination has no meaning (not a deepoffload refusal)."""


def _init_of(model: nn.Module) -> Callable | None:
    return getattr(model, "_init_weights", None)


def _compute_bf16_in_memory(model: nn.Module) -> nn.Module:
    """What ``compute_dtype=torch.bfloat16`` computes, in memory: each block runs with bfloat16 copies of its
    fp32 parameters (gradients cast back), its floating-point inputs cast to bfloat16 and its bfloat16 outputs cast
    back; parameters of submodules with fp32 buffers (BatchNorm) stay fp32."""
    from torch.utils import _pytree as pytree

    from deepoffload.swap.params.blocks.residency import own_dtype_parameters

    for _, block in find_blocks(model):
        own = own_dtype_parameters(block, torch.bfloat16)
        forward = block.forward

        def run(*args, _block=block, _forward=forward, _own=own, **kwargs):
            flat = pytree.tree_leaves((args, kwargs))
            outer = next(
                (x.dtype for x in flat if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.bfloat16
            )

            def cast(x, to, only=None):
                if isinstance(x, torch.Tensor) and x.is_floating_point() and (only is None or x.dtype == only):
                    return x.to(to)
                return x

            args, kwargs = pytree.tree_map(lambda x: cast(x, torch.bfloat16), (args, kwargs))
            params = {n: p if id(p) in _own else p.to(torch.bfloat16) for n, p in _block.named_parameters()}
            out = torch.func.functional_call(_block, params, args, kwargs, tie_weights=False, strict=False)
            return pytree.tree_map(lambda x: cast(x, outer, only=torch.bfloat16), out)

        # functional_call runs the module's forward: keep the original one reachable under another name
        block._matrix_forward = forward
        block.forward = _Unwrapped(run, forward)
    return model


class _Unwrapped:
    """The casting forward of a block; inside ``functional_call`` the block's own forward runs."""

    def __init__(self, outer: Callable, inner: Callable):
        self.outer, self.inner, self.depth = outer, inner, 0

    def __call__(self, *args, **kwargs):
        if self.depth:
            return self.inner(*args, **kwargs)
        self.depth += 1
        try:
            return self.outer(*args, **kwargs)
        finally:
            self.depth -= 1


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "fp16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


# -- loops ------------------------------------------------------------------------------------------------------
def plain_loop(setup: Setup) -> list[float]:
    model, optimizer = setup.model, setup.optimizer
    scaler = torch.amp.GradScaler("cpu") if setup.precision == "fp16" else None
    losses = []
    for k in range(STEPS):
        torch.manual_seed(100 + k)
        with _autocast(setup.precision):
            loss = loss_of(model(**batch(setup.name, k)))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def serve_loop(setup: Setup) -> list[float]:
    """Inference: the logits of a few batches (as their sums' bits, exact) under the precision's autocast."""
    setup.model.eval()
    out = []
    with torch.no_grad(), _autocast(setup.precision):
        for k in range(STEPS):
            logits = setup.model(**batch(setup.name, k))["logits"]
            out.append(logits.double().sum().item())
    return out


def accelerate_loop(setup: Setup) -> list[float]:
    """accelerate's Accelerator with 2 micro-batches per step (``accumulate``) and ``clip_grad_norm_``; a streamed
    model in grads mode clips with ``StreamedOptimizer(clip_grad_norm=)`` instead (its gradients are on storage)."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(setup.precision, "no")
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, mixed_precision=precision, cpu=True)
    model, optimizer = accelerator.prepare(setup.model, setup.optimizer)
    clip_here = not (setup.off is not None and setup.off.mode == "grads")
    losses = []
    try:
        for k in range(2 * STEPS):
            torch.manual_seed(100 + k)
            with accelerator.accumulate(model):
                loss = loss_of(model(**batch(setup.name, k)))
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip_here:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    finally:  # accelerate's state is process-wide: the next cell starts without it
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return losses


def trainer_loop(setup: Setup) -> list[float]:
    """transformers' Trainer: 3 steps saving a checkpoint at step 2, then a fresh setup resumed from it; the
    losses logged by both runs."""
    import transformers

    data = [batch(setup.name, k) for k in range(STEPS)]
    dataset = [{k: v[i] for k, v in b.items()} for b in data for i in range(2)]

    def trainer(s: Setup, out: Path) -> transformers.Trainer:
        args = transformers.TrainingArguments(
            output_dir=str(out),
            max_steps=STEPS,
            per_device_train_batch_size=2,
            learning_rate=LR,
            save_steps=2,
            save_strategy="steps",
            logging_steps=1,
            report_to=[],
            max_grad_norm=0.0,
            seed=0,
            use_cpu=True,
            bf16=s.precision == "bf16",
            fp16=s.precision == "fp16",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        kwargs = trainer_arguments(s.off) if s.off is not None else {"optimizers": (s.optimizer, None)}
        return transformers.Trainer(model=s.model, args=args, train_dataset=dataset, **kwargs)

    out = setup.folder / "trainer"
    first = trainer(setup, out)
    first.train()
    losses = [log["loss"] for log in first.state.log_history if "loss" in log]
    resumed_setup = Setup(setup.name, setup.precision, setup.loop, setup.feature, setup.folder / "resumed")
    try:
        second = trainer(resumed_setup, out)
        second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        losses += [log["loss"] for log in second.state.log_history if "loss" in log]
        first_state = setup.state()
        if any(not torch.equal(v, first_state[k]) for k, v in resumed_setup.state().items()):
            losses.append(float("nan"))  # the resumed run ended elsewhere than the uninterrupted one
        setup.close()
        setup.__dict__.update(resumed_setup.__dict__)
    except BaseException:
        resumed_setup.close()
        raise
    return losses


LOOP_RUNNERS = {
    "plain": plain_loop,
    "trainer": trainer_loop,
    "accelerate": accelerate_loop,
    "lora": plain_loop,
    "lora_served": plain_loop,
}


# -- one cell ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: str
    detail: str = ""


_references: dict[tuple, Any] = {}


class Refused(Exception):
    """The offloaded run raised; ``changed``: parameters had changed by then (a refusal after a step)."""

    def __init__(self, error: BaseException, changed: bool):
        super().__init__(str(error))
        self.error, self.changed = error, changed


def _train(name: str, precision: str, loop: str, feature: str | None, folder: Path) -> Run:
    try:
        setup = Setup(name, precision, loop, feature, folder)
    except (ValueError, RuntimeError, TypeError) as e:  # refused while setting up (lora_served: adapters taken)
        if feature is None:
            raise
        raise Refused(e, False) from e
    try:
        runner = serve_loop if feature == "serve" and loop == "plain" else LOOP_RUNNERS[loop]
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                with _activations(feature, folder) as off:
                    losses = runner(setup)
                if off is not None and not off.stats()["written"]:  # a cell that stored nothing would prove nothing
                    raise RuntimeError("offload_activations wrote no saved tensor")  # (an "error" cell)
            except (ValueError, RuntimeError, TypeError) as e:
                if feature is None:
                    raise
                raise Refused(e, _changed(setup, name)) from e
        return Run(losses, setup.state(), {} if runner is serve_loop else setup.optimizer_state())
    finally:
        setup.close()


def _activations(feature: str | None, folder: Path) -> contextlib.AbstractContextManager:
    """The ``activations`` column: every step's forward and backward (the whole loop) inside one
    ``offload_activations`` context that writes every saved tensor (``min_bytes=0``: the models are tiny)."""
    if feature != "activations":
        return contextlib.nullcontext()
    from deepoffload import offload_activations

    return offload_activations(str(folder / "activations"), min_bytes=0)


def _changed(setup: Setup, name: str) -> bool:
    """Whether the offloaded model's parameters differ from those it started with (unreadable counts as changed;
    buffers such as BatchNorm statistics change in any forward, in memory too, and are not looked at)."""
    model = build(name)
    initial = {k: p.detach() for k, p in model.named_parameters()}
    try:
        now = setup.state()
    except Exception:  # noqa: BLE001
        return True
    return any(k in now and not torch.equal(v, now[k]) for k, v in initial.items())


def reference(name: str, precision: str, loop: str, serving: bool, folder: Path) -> Run | BaseException:
    key = (name, precision, loop, serving)
    if key not in _references:
        try:
            if serving:
                setup = Setup(name, precision, loop, None, folder)
                _references[key] = Run(serve_loop(setup), setup.state(), {})
            else:
                _references[key] = _train(name, precision, loop, None, folder)
        except Exception as e:  # noqa: BLE001  (the loop refuses the combination in memory too)
            _references[key] = e
    return _references[key]


def run_cell(name: str, precision: str, loop: str, feature: str, folder: str | os.PathLike) -> Outcome:
    folder = Path(folder)
    if feature == "storage_cache":  # generate cells: tests/support/matrix_generate.py (also when run as a script)
        generate = importlib.import_module("tests.support.matrix_generate" if __package__ else "matrix_generate")
        return generate.storage_cache_cell(sys.modules[__name__], name, precision, loop, folder)
    serving = feature == "serve" and loop == "plain"
    expected = reference(name, precision, loop, serving, folder / "reference")
    if isinstance(expected, BaseException):
        return Outcome("in-memory fails too", _first_line(expected))
    try:
        got = _train(name, precision, loop, feature, folder / "offloaded")
    except NotApplicable as e:
        return Outcome("not applicable", str(e))
    except Refused as e:
        text = _first_line(e.error)
        if not _from_deepoffload(e.error):
            return Outcome("error", text)
        return Outcome("refused late" if e.changed else "refused", text)
    for equal in (_identical, _rounding) if name in ROUNDING else (_identical,):
        problem = _compare(got, expected, equal)
        if problem is None:
            return Outcome("identical") if equal is _identical else Outcome("rounding", ROUNDING[name])
    if name in ROUNDING:  # the known cause, amplified (Adam's normalised steps, bf16): listed as not exact
        return Outcome("not exact", f"{ROUNDING[name]}; here beyond rounding: {_compare(got, expected, _rounding)}")
    return Outcome("differs", _compare(got, expected, _identical))


# models whose streamed training is not bit-identical to memory, and why: "rounding" when equal within a tolerance,
# else "not exact" (a known limitation the support matrix shows, accepted for these models only). None now: T5's
# encoder output and position bias, which reach several blocks, have their gradients summed in memory's order
# (deepoffload/swap/params/autograd/shared_inputs.py)
ROUNDING: dict[str, str] = {}


def acceptable(model: str, outcome: Outcome) -> bool:
    """A cell outcome the matrix accepts (``not exact`` only for the models in ``ROUNDING``)."""
    ok = ("identical", "rounding", "refused", "in-memory fails too", "not applicable")
    return outcome.status in ok or (outcome.status == "not exact" and model in ROUNDING)


def _identical(a: Any, b: Any) -> bool:
    """Bit for bit; NaN equals NaN (a trainer run marks a resumed run that ended elsewhere with a NaN loss, and
    transformers' own Mixtral does so in memory too)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        if same and a.is_floating_point():
            return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        return same and torch.equal(a, b)
    return a == b


def _rounding(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
        )
    return _identical(a, b)


def _compare(got: Run, expected: Run, equal: Callable[[Any, Any], bool]) -> str | None:
    """What differs between the two runs (None: nothing)."""
    if not all(equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(got.losses, expected.losses)) or len(
        got.losses
    ) != len(expected.losses):
        return f"losses {got.losses} != {expected.losses}"
    bad = [k for k, v in expected.state.items() if k not in got.state or not equal(v, got.state[k])]
    if bad:
        return f"state differs: {', '.join(bad[:4])}"
    bad = [k for k, v in expected.optimizer.items() if not _equal_entries(v, got.optimizer.get(k), equal)]
    if bad or set(got.optimizer) != set(expected.optimizer):
        return f"optimizer state differs: {', '.join((bad or sorted(got.optimizer))[:4])}"
    return None


def _equal_entries(a: dict, b: dict | None, equal: Callable[[Any, Any], bool]) -> bool:
    if b is None or set(a) != set(b):
        return False
    return all(equal(v, b[k]) for k, v in a.items())


def _first_line(error: BaseException) -> str:
    """The error's type and first line, its file paths (temporary folders) as <path>."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {re.sub(r'(?<=[ (])/[^ )]+', '<path>', text)}"


def _from_deepoffload(error: BaseException) -> bool:
    """A refusal of deepoffload's own (raised in its code, saying what to use instead), not a crash elsewhere."""
    import traceback

    inner = error
    while inner.__cause__ is not None:
        inner = inner.__cause__
    raised_here = any(
        f"{os.sep}deepoffload{os.sep}" in frame.filename for frame in traceback.extract_tb(inner.__traceback__)[-3:]
    )
    text = str(inner).lower()
    return raised_here and any(
        w in text for w in ("use ", "pass ", "instead", "before ", "set ", "without ", "freeze ", "call ", "leave ")
    )


def cells():
    return itertools.product(MODELS, PRECISIONS, LOOPS, FEATURES)


def support_matrix(results: dict[tuple, Outcome]) -> str:
    lines = [
        "# Support matrix",
        "",
        "Generated by `python tests/support/matrix_harness.py --write docs/support-matrix.md` (the differential "
        "matrix of `tests/swap/params/test_params_matrix.py` and `tests/swap/params/matrix/`, which check cells "
        "against this page in CI: every pair of axis values, every cell of the `plain` loop, and the other loops "
        "for the first five models and features; every cell with `DEEPOFFLOAD_TEST_FULL_MATRIX=1`): each cell trains "
        "a tiny model for 3 steps in "
        "memory and with deepoffload on the "
        "same batches and seeds. **identical**: losses, parameters, buffers and optimizer state bit-identical; "
        "**rounding**: equal within rounding only, for the reason given below; **not exact**: the same "
        "cause amplified beyond rounding (a known limitation of that model, see its message); "
        "**refused**: deepoffload raises before the first step, saying what to use instead; **in-memory fails "
        "too**: the training loop itself refuses the combination on this machine; **not applicable**: the "
        "combination has no meaning; **not run**: the run that wrote this file did not reach it.",
        "",
        "Features: `optimizer` = `OffloadedOptimizer` alone; `fused`, `grads` = `TrainOptions(mode=...)`; "
        "`half` = grads mode with half the blocks resident (`StreamOptions(max_resident_bytes)`); `serve` = "
        "`LoadOptions(serve_from_checkpoint=True)` (inference; training refused); `codec` = grads mode with "
        '`SwapConfig(codec="lossless")`; `two_folders` = fused mode with '
        "swap folders on two drives (`path=[a, b]`, two tmpfs mounts); `activations` = the in-memory model "
        "trained inside `offload_activations(min_bytes=0)` (every saved tensor written to storage and read back for "
        "the backward); `storage_cache` = `generate` with "
        "`deepoffload.StorageCache` against `DynamicCache` (greedy, sampling, beams: same tokens; plain loop only). "
        "`kept_graph` = grads mode with `StreamOptions(recompute=False)` (frozen blocks keep their forward's graph; "
        "`lora_served` only, the loop with a frozen base). "
        "In the `lora` row PEFT LoRA comes after offloading, over the served base. Loops: `plain` (hand-written), "
        "`trainer` (transformers `Trainer`, checkpoint at step 2 and a resumed run), `accelerate` (`Accelerator` with "
        "`accumulate` and `clip_grad_norm_`), `lora` (PEFT LoRA before offloading), "
        "`lora_served` (PEFT LoRA after offloading over a base "
        "served from its checkpoint, in each mode). Precisions: `bf16`/`fp16` "
        "= `torch.autocast` (fp16 with `GradScaler`), `compute_bf16` = "
        "`StreamOptions(compute_dtype=torch.bfloat16)`. On a CPU (where this matrix runs) accelerate, and the "
        "`Trainer` through it, ignore fp16 (no autocast, no scaler): their fp16 rows train in fp32; on an "
        "accelerator they use fp16 autocast with a `GradScaler`, which grads mode trains as the plain-loop fp16 rows "
        "show and fused mode refuses (the Trainer's own fp16 path is tested on a CPU in "
        "tests/swap/params/test_params_fp16.py).",
        "",
    ]
    refusals: dict[str, int] = {}
    for model in MODELS:
        lines += [
            f"## {model}",
            "",
            "| precision | loop | " + " | ".join(FEATURES) + " |",
            "| --- | --- | " + " | ".join("---" for _ in FEATURES) + " |",
        ]
        for precision, loop in itertools.product(PRECISIONS, LOOPS):
            row = []
            for feature in FEATURES:
                outcome = results.get((model, precision, loop, feature), Outcome("not run"))
                mark = outcome.status
                if outcome.detail and outcome.status != "identical":
                    number = refusals.setdefault(outcome.detail, len(refusals) + 1)
                    mark += f" [{number}]"
                row.append(mark)
            lines.append(f"| {precision} | {loop} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Messages", ""]
    lines += [f"{number}. {detail.replace('|', '/')}" for detail, number in refusals.items()]
    return "\n".join(lines) + "\n"


def page_outcomes(text: str) -> dict[tuple[str, str, str, str], Outcome]:
    """The outcomes a support-matrix page (``support_matrix``'s output) shows, with their messages; columns are read
    from each table's header, so a page written before a feature was added still reads (its new cells are absent)."""
    messages = dict(re.findall(r"^(\d+)\. (.*)$", text, flags=re.M))
    out: dict[tuple[str, str, str, str], Outcome] = {}
    model, features = None, []
    for line in text.splitlines():
        heading = re.match(r"## (\w+)$", line)
        if heading:
            model, features = heading.group(1), []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["precision", "loop"]:
            features = cells[2:]
        elif model in MODELS and features and len(cells) == 2 + len(features) and cells[0] in PRECISIONS:
            for feature, mark in zip(features, cells[2:]):
                found = re.match(r"(.*?)(?: \[(\d+)\])?$", mark)
                status, number = (found.group(1), found.group(2)) if found else (mark, None)
                out[(model, cells[0], cells[1], feature)] = Outcome(status, messages.get(number or "", ""))
    return out


def main(argv: list[str]) -> int:
    """``--models a,b``, ``--precisions p,q``, ``--loops c,d`` and ``--features e,f`` run those cells only;
    ``--json FILE`` saves the outcomes; ``--write FILE`` writes the support matrix of the outcomes run here plus those
    of ``--merge FILE,...`` (saved by other runs; a later file's outcome of a cell replaces an earlier one's) and, with
    ``--keep``, those that FILE already shows for the cells not run here (to add one column without running the
    other 400 cells)."""
    import json

    def option(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    models = (option("--models") or ",".join(MODELS)).split(",")
    loops = (option("--loops") or ",".join(LOOPS)).split(",")
    features = (option("--features") or ",".join(FEATURES)).split(",")
    precisions = (option("--precisions") or ",".join(PRECISIONS)).split(",")
    results: dict[tuple, Outcome] = {}
    if "--keep" in argv and option("--write") and Path(option("--write")).exists():
        results.update(page_outcomes(Path(option("--write")).read_text()))
    with tempfile.TemporaryDirectory() as base:
        wanted = (models, precisions, loops, features)
        for k, cell in enumerate(c for c in cells() if all(part in w for part, w in zip(c, wanted))):
            results[cell] = run_cell(*cell, Path(base) / str(k))
            print(*cell, results[cell].status, results[cell].detail[:150], flush=True)
            if option("--json"):  # after each cell: an interrupted run keeps what it did
                Path(option("--json")).write_text(json.dumps([[*c, o.status, o.detail] for c, o in results.items()]))
    for saved in filter(None, (option("--merge") or "").split(",")):
        results.update({tuple(row[:4]): Outcome(row[4], row[5]) for row in json.loads(Path(saved).read_text())})
    if option("--write"):
        Path(option("--write")).write_text(support_matrix(results))
    return 0 if all(acceptable(cell[0], o) for cell, o in results.items()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
