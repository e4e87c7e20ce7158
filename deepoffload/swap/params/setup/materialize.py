"""Give a model built on the ``meta`` device its values block by block, writing each block to storage.

Each block is written before the next is made, so the whole model never exists in memory.

``Materializer`` runs where ``BlockStore.offload_all`` would (see ``ParameterOffload``): it walks the module children
first (post-order, the order in which constructors initialize: a module's children exist before its own
``reset_parameters`` runs, and the order of transformers' ``initialize_weights``); the tensors of a module outside the
blocks are made in memory (they stay there), a block's parameters are made, filled, written out and released (one
block's write in flight while the next is made: at most three blocks in memory, the one being made and the one being
written with its staging copy). Values come from a checkpoint (``CheckpointReader.read_into``: safetensors through the
async-IO op, torch.save by mmap) or, for tensors it lacks or without one, from an initializer called per module owning
such tensors, in that walk order: ``init(module)`` (e.g. a Hugging Face model's ``_init_weights``) or else the module's
own ``reset_parameters()`` (``_reset_parameters()`` where that is torch's name, as in ``nn.MultiheadAttention``). A
module that owns no tensor itself is not called: re-initializations a parent makes of its children's tensors
(``nn.Transformer``'s ``_reset_parameters``) are not repeated, so such a model gets other (equally distributed) values
than in memory.

Nothing is left unset silently: tensors made here are filled with NaN (integer ones with their dtype's least value)
before initialization and any such value left afterwards is an error naming the tensor; boolean ones (no value marks
them) are initialized twice, from False and from True, and an element that differs is an error. A non-persistent buffer
of a block still unset is left for its ancestors' initializer after the walk (``deferred_init``). A tensor of the
``state_dict()`` that the checkpoint lacks gets a value from an initializer only where ``init=`` asks for it
(``InitPolicy``); the checkpoint is read in the model's names by the rules of its family (``model_rules``: a
transformers model's by transformers' own loading rules). Meta parameters are replaced by new ``nn.Parameter``
objects (a meta tensor cannot take CPU data in place); on any failure the original meta parameters and buffers are
put back.
"""

from __future__ import annotations

import os
from typing import Iterator, cast

import torch
from torch import nn

from ....errors import ResidencyError
from ....formats.checks import KeyReport
from ....formats.header import CheckpointError
from ....formats.reader import NAMES_HINT, CheckpointReader
from ....io.buffers import aligned_empty
from ...pool import trim_heap
from ...tensor_swapper import SwapRecord
from ..blocks.residency import Block, Residency, dense_layout
from ..budget import READER_INFLIGHT_BYTES, READER_SPAN_BYTES
from ..storage.sources import CheckpointFiles
from .deferred_init import init_ancestors
from .init_policy import Init, InitPolicy
from .model_rules import CheckpointView, rules_for, tie_weights


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` holding one element (stride 0): it carries the shape without memory."""
    return torch.empty(1, dtype=dtype).expand(shape) if len(shape) else torch.empty((), dtype=dtype)


def transient_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in memory mapped for it alone (page-aligned, not locked).

    It is unmapped when the tensor and its views are gone. A block-sized ``torch.empty`` would come from glibc's heap
    once its dynamic mmap threshold has risen (up to 32 MiB), and freed heap memory stays in the process: made and
    released block after block, such tensors grow the process towards the model's size.

    Args:
        shape: Its shape.
        dtype: Its dtype.

    Returns:
        The tensor.
    """
    return aligned_empty(shape, dtype, pin=False)


def _unset(dtype: torch.dtype) -> float | int | bool:
    """The value that marks a tensor no initializer wrote (booleans: False; none marks them, see ``_initialize``)."""
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min if not (dtype.is_floating_point or dtype.is_complex) else float("nan")


def _is_unset(t: torch.Tensor) -> torch.Tensor:
    return torch.isnan(t) if t.is_floating_point() or t.is_complex() else t == _unset(t.dtype)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the ``meta`` device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


class Materializer:
    """A model's values made block by block from a checkpoint or an initializer, straight to storage.

    ``offload_parameters`` makes it before the blocks are set up: it swaps meta parameters for shape-only placeholders
    and checks the checkpoint's names and shapes, reading no data; ``offload`` then fills and writes.

    Args:
        module: The model, built on the ``meta`` device or to be loaded from ``checkpoint``.
        block_prefixes: The blocks' qualified names.
        checkpoint: A path ``CheckpointReader`` opens, or None.
        init: Which tensors the checkpoint lacks may be initialized, and by what (see ``InitPolicy``): a function
            called with each module owning such tensors, ``state_dict()`` names/patterns, or None (only what no
            checkpoint holds: non-persistent buffers; everything without a checkpoint). The default initializer
            is the model's own (its model rules': a Hugging Face model's ``_init_weights``), else each module's
            ``reset_parameters()``.
        dtype: The dtype of floating-point parameters made from meta (None: as built); buffers keep theirs (rotary
            ``inv_freq`` stays fp32, as in ``from_pretrained``).
        strict: Refuse missing and unexpected checkpoint names (mis-shaped ones always are).
        serve: Blocks whose parameters all lie in a safetensors checkpoint in their target dtype, back to back in one
            file, and which have no meta buffers, are not copied: their records point into the checkpoint
            (read-only).

    Raises:
        ValueError: When ``serve`` is asked of a checkpoint that is not safetensors.
        CheckpointError: When the checkpoint's names or shapes do not match the module's (see ``strict``).
    """

    def __init__(
        self,
        module: nn.Module,
        block_prefixes: list[str],
        *,
        checkpoint: str | os.PathLike | None,
        init: Init | None,
        dtype: torch.dtype | None,
        strict: bool,
        serve: bool = False,
    ):
        self.module = module
        self.serve = serve
        self.policy = InitPolicy(module, init, checkpoint is not None)
        self.init = self.policy.function
        self.dtype = dtype
        self.block_prefixes = block_prefixes
        self.reader: CheckpointView | None = None
        self.report = KeyReport([], [])
        self._swapped: list[tuple[nn.Module, str, torch.Tensor]] = []  # (module, name, original) to put back
        self._todo: set[int] = set()  # ids of tensors made here that need a value
        # ids of shape-only placeholder parameters -> the meta one's dense_layout (values made in it, as to_empty)
        self._placeholders: dict[int, tuple[int, ...] | None] = {}
        self._initialized: set[int] = set()  # ids of tensors made here that init= (not a checkpoint) gave values
        self._deferred: dict[str, torch.Tensor] = {}  # unset non-persistent buffers left for init_ancestors
        self._non_persistent = {n for n, _ in module.named_buffers()} - set(module.state_dict(keep_vars=True))
        tie_weights(module)
        self.rules = rules_for(module)
        self._kept_fp32 = self.rules.kept_in_float32(module, dtype) if dtype is not None else set()
        if checkpoint is not None:
            # read_into keeps at most inflight + one span of buffers (budget.READER_BYTES), whatever the model's size
            reader = CheckpointReader(checkpoint, span_bytes=READER_SPAN_BYTES, inflight_bytes=READER_INFLIGHT_BYTES)
            self.reader = reader
            try:
                if serve and not reader.serves:  # (the registry says which formats' bytes lie as stored)
                    raise ValueError(
                        f"serve_from_checkpoint=True needs a safetensors checkpoint (its tensors are "
                        f"read where they lie); {checkpoint} is a {reader.format} file"
                    )
                self.reader = self.rules.checkpoint(reader, module)  # (in the model's names: transformers' rules)
                self.report = self._check(self.reader, strict)
            except BaseException:
                reader.close()
                raise
        elif self.policy.patterns is not None:
            state = module.state_dict(keep_vars=True)
            self.policy.check_missing([n for n, t in state.items() if t.is_meta], set(), "without checkpoint=, it")
        self._replace_meta_parameters()

    # -- preparing ----------------------------------------------------------------------------------------------
    def _target_dtype(self, t: torch.Tensor) -> torch.dtype:
        if id(t) in self._kept_fp32:  # (the model rules': transformers' _keep_in_fp32_modules, kept as built)
            return t.dtype
        if self.dtype is not None and t.is_meta and t.is_floating_point() and isinstance(t, nn.Parameter):
            return self.dtype
        return t.dtype

    def _check(self, reader: CheckpointView, strict: bool) -> KeyReport:
        """Compare the checkpoint with the module's state (names, shapes, convertible dtypes).

        A tensor shared by several names (tied weights) needs only one of them in the checkpoint. A tensor on the
        ``meta`` device that the checkpoint lacks needs ``init=`` (see ``InitPolicy``).

        Args:
            reader: The open checkpoint.
            strict: Refuse missing and unexpected names.

        Returns:
            The names the checkpoint lacks and those it has beyond the module.

        Raises:
            CheckpointError: When names or shapes do not match, or a meta tensor would have no value.
        """
        state = self.module.state_dict(keep_vars=True)
        aliases: dict[int, list[str]] = {}
        for name, t in state.items():
            aliases.setdefault(id(t), []).append(name)
        expected = {}
        for names in aliases.values():
            present = [n for n in names if n in reader]
            for name in present or names:
                t = state[name]
                expected[name] = (tuple(t.shape), self._target_dtype(t))
        try:
            report = reader.check(expected, strict=strict)
        except CheckpointError as e:
            needy = [n for n in expected if n not in reader and state[n].is_meta]
            if not needy:
                raise
            message = str(e).replace(NAMES_HINT, "")  # strict=False alone leaves these without a value
            raise CheckpointError(f"{message}{self.policy.missing_advice(needy, strict=True)}") from None
        declared = self.rules.missing_allowed(self.module, report.missing)
        self.policy.check_missing([n for n in report.missing if state[n].is_meta], declared, str(reader.path))
        return report

    def _replace_meta_parameters(self) -> None:
        replaced: dict[int, nn.Parameter] = {}
        for module in self.module.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) not in replaced:
                    dtype = self._target_dtype(param)
                    new = nn.Parameter(_placeholder(param.shape, dtype), requires_grad=param.requires_grad)
                    replaced[id(param)] = new
                    self._todo.add(id(new))
                    self._placeholders[id(new)] = dense_layout(param)
                self._swapped.append((module, name, param))
                module._parameters[name] = replaced[id(param)]

    def layout_of(self, param: torch.Tensor) -> tuple[int, ...] | None:
        """``dense_layout`` of ``param``, or of the meta parameter whose placeholder it still is."""
        return self._placeholders[id(param)] if id(param) in self._placeholders else dense_layout(param)

    def undo(self) -> None:
        """Put back the original meta parameters and buffers (after a failure)."""
        for module, name, original in reversed(self._swapped):
            if name in module._parameters:  # (swapped by _replace_meta_parameters: a Parameter)
                module._parameters[name] = cast(nn.Parameter, original)
            else:
                module._buffers[name] = original
        self._swapped = []
        self.close()

    def close(self) -> None:
        """Close the checkpoint reader, if any."""
        if self.reader is not None:
            self.reader.close()

    # -- making values ------------------------------------------------------------------------------------------
    def _make(self, module: nn.Module, prefix: str, transient: bool = False) -> dict[str, torch.Tensor]:
        """Give the module's own (not its children's) placeholder parameters and meta buffers memory.

        Args:
            module: The module.
            prefix: Its qualified name with a trailing dot ("" for the top module).
            transient: The tensors of a block, written out and released at once: their memory is mapped for them
                (``transient_empty``), so it goes back to the system when they are released.

        Returns:
            The module's own tensors by qualified name.
        """
        empty = transient_empty if transient else torch.empty
        tensors: dict[str, torch.Tensor] = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in self._placeholders:
                made, layout = empty(param.shape, dtype=param.dtype), self._placeholders.pop(id(param))
                param.data = made if layout is None else made.as_strided(param.shape, layout)
            tensors[prefix + name] = param
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.is_meta:
                made = empty(buffer.shape, dtype=self._target_dtype(buffer))
                self._swapped.append((module, name, buffer))
                module._buffers[name] = made
                self._todo.add(id(made))
                buffer = made
            tensors[prefix + name] = buffer
        return tensors

    def _fill(self, owners: list[tuple[nn.Module, dict[str, torch.Tensor]]]) -> None:
        """Give values to the tensors of ``owners`` (modules with their own tensors, in walk order).

        The modules owning a tensor that needs one and the checkpoint lacks are initialized, then what the checkpoint
        has is read.
        """
        reader = self.reader
        loaded = {n: t for _, tensors in owners for n, t in tensors.items() if reader is not None and n in reader}
        needy = [
            (m, tensors)
            for m, tensors in owners
            if any((id(t) in self._todo or id(t) in self._initialized) and n not in loaded for n, t in tensors.items())
        ]
        if needy:
            self._initialize(needy, loaded)
        if loaded and reader is not None:  # (loaded is empty without a reader)
            reader.read_into({n: t.detach() for n, t in loaded.items()})
        for _, tensors in owners:
            for t in tensors.values():
                self._todo.discard(id(t))

    def _initialize(self, needy: list[tuple[nn.Module, dict[str, torch.Tensor]]], loaded: dict) -> None:
        unset = {n: t for _, tensors in needy for n, t in tensors.items() if id(t) in self._todo and n not in loaded}
        # a tensor init= already gave values through an earlier module (tied weights) is initialized again by each
        # later module holding it, as transformers' initialize_weights() does: the last one's values stay
        again = {n for _, tensors in needy for n, t in tensors.items() if id(t) in self._initialized}
        booleans = {n: t for n, t in unset.items() if t.dtype == torch.bool}  # no value marks them: set twice
        kept = {}  # tensors that already had values in a module being initialized: keep them
        for _, tensors in needy:
            for n, t in tensors.items():
                if n not in unset and n not in loaded and n not in again:
                    kept[n] = t.detach().clone()
        with torch.no_grad():
            for t in unset.values():
                t.fill_(_unset(t.dtype))
            self._call_init([m for m, _ in needy])
            if booleans:  # initialized again from True: a boolean the initializer sets comes out the same
                first = {n: t.clone() for n, t in booleans.items()}
                for t in booleans.values():
                    t.fill_(True)
                self._call_init([m for m, tensors in needy if any(n in booleans for n in tensors)])
                differ = [n for n, t in booleans.items() if not torch.equal(t, first[n])]
            for _, tensors in needy:
                for n, t in tensors.items():
                    if n in kept:
                        t.copy_(kept[n])
        if self.init is not None:
            self._initialized.update(id(t) for t in unset.values())
        left = [n for n, t in unset.items() if n not in booleans and _is_unset(t).any()]
        if self.init is not None:  # a non-persistent buffer an ancestor's initializer may set: after the walk
            self._deferred.update({n: unset[n] for n in left if n in self._non_persistent})
            left = [n for n in left if n not in self._deferred]
        if booleans:
            left += differ  # (the initializer did not set them)
        if left:
            how = "init= left them unset" if self.init is not None else "their modules have no reset_parameters()"
            raise ValueError(
                f"{left[:10]}: on the meta device and without a value ({how}"
                f"{'; the checkpoint lacks them' if self.reader else ''}); pass load=LoadOptions(init=...) a "
                f"function that initializes each module (e.g. a Hugging Face model's _init_weights), or "
                f"load=LoadOptions(checkpoint=...) a checkpoint holding them"
            )

    def _call_init(self, modules: list[nn.Module]) -> None:
        for module in modules:
            if self.init is not None:
                self.init(module)
            else:
                reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
                if callable(reset):
                    reset()

    def _walk(self, blocks: dict[str, Block]) -> Iterator[tuple[str, nn.Module, Block | None]]:
        """(name, module, its Block or None), children before parents; a block is one item."""
        seen: set[int] = set()

        def visit(module: nn.Module, prefix: str):
            if id(module) in seen:
                return
            seen.add(id(module))
            name = prefix[:-1]
            if name in blocks:
                yield name, module, blocks[name]
                return
            for child_name, child in module.named_children():
                yield from visit(child, f"{prefix}{child_name}.")
            yield name, module, None

        yield from visit(self.module, "")

    @staticmethod
    def _post_order(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        for name, child in module.named_children():
            found.extend(Materializer._post_order(child, f"{prefix}{name}."))
        found.append((prefix, module))
        return found

    def _served_records(self, block: Block) -> dict[str, SwapRecord] | None:
        """Where the block's parameters lie in the checkpoint, when it can be served from there (see ``serve``).

        Returns:
            The parameters' records in the checkpoint by name, or None (the block is copied).
        """
        if not self.serve or self.reader is None or any(b.is_meta for b in block.module.buffers()):
            return None
        records = {}
        for name, master in zip(block.names, block.masters):
            entry = self.reader.location(block.qualified(name))
            if entry is None or entry.dtype != master.dtype or tuple(entry.shape) != tuple(master.shape):
                return None
            records[name] = SwapRecord(
                name, entry.dtype, tuple(entry.shape), entry.nbytes, str(entry.path), entry.start, torch.device("cpu")
            )
        base = min((r.offset for r in records.values()), default=0)
        end = max((r.offset + r.nbytes for r in records.values()), default=0)
        if (
            len({r.file for r in records.values()}) != 1
            or end - base != sum(r.nbytes for r in records.values())
            or any(r.offset % r.dtype.itemsize for r in records.values())
        ):
            return None
        return records

    # -- the pass -----------------------------------------------------------------------------------------------
    def offload(self, store, blocks: list[Block]) -> None:
        """Make, fill and write every block in walk order (releasing each once written) and make the rest in memory.

        On failure: the swap files are removed, the module gets its meta tensors back, and this raises.

        Args:
            store: The ``BlockStore`` the blocks are written to (or served from the checkpoint by).
            blocks: The blocks.

        Raises:
            ValueError: When a non-persistent buffer is still unset after its ancestors' initializer ran.
        """
        writes: list[Block] = []
        try:
            for prefix, module, block in self._walk({b.prefix: b for b in blocks}):
                if block is None:
                    self._fill([(module, self._make(module, prefix + "." if prefix else ""))])
                    continue
                served = self._served_records(block)
                if served is not None:
                    store.serve(block, served)
                    block.source = CheckpointFiles(next(iter(served.values())).file)
                    block.clear_data()
                    block.move(Residency.ON_STORAGE)
                    continue
                owners = [
                    (m, self._make(m, qualified, transient=True))
                    for qualified, m in self._post_order(module, prefix + ".")
                ]
                for master, param in zip(block.masters, block.params):
                    if master is not param:
                        master.data = param.data  # the walk filled the parameters; the masters are what is stored
                self._fill(owners)
                while writes:  # before this block's staging copy: a fourth block's memory otherwise
                    self._finish(store, writes.pop(0))
                block.write = store.write_masters(block)
                writes.append(block)
            while writes:
                self._finish(store, writes.pop(0))
            if self._deferred and self.init is not None:
                streamed = {id(t) for b in blocks for t in (*b.params, *b.masters)}
                left = init_ancestors(self.module, self._deferred, self.init, _is_unset, streamed)
                if left:
                    raise ValueError(
                        f"{left[:10]}: non-persistent buffers on the meta device no initializer set; pass "
                        f"load=LoadOptions(init=...) a function that sets them, or build the model with its buffers "
                        f"in memory (accelerate's init_empty_weights() keeps them)"
                    )
        except BaseException:
            for block in writes:
                try:
                    if block.write is not None:  # (always: set before the block joined writes)
                        block.write.wait()
                except OSError:
                    pass  # the first failure is the one reported
                block.write = None
            try:
                store.close()
            except OSError:
                pass  # the error being raised is the one to report; closing is best effort here
            self.undo()
            raise
        self.close()
        self._swapped = []

    @staticmethod
    def _finish(store, block: Block) -> None:
        write, block.write = block.write, None
        if write is None:
            raise ResidencyError(
                f"block {block.prefix}: no write of its parameters is in flight (a bookkeeping bug "
                f"in deepoffload; please report it)"
            )
        try:
            write.wait()
        except OSError as e:
            raise OSError(
                e.errno,
                f"writing the parameters of block {block.prefix} to storage failed "
                f"({e.strerror}); nothing was offloaded",
                e.filename,
            ) from e
        block.clear_data()
        block.move(Residency.ON_STORAGE)
        trim_heap()  # what reading the block freed (conversions, the reader's own tensors) goes back to the system


__all__ = ["CheckpointError", "Materializer", "has_meta"]
