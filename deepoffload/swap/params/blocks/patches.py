"""What ``ParameterOffload`` attaches to the user's modules, and takes off again.

Each block's streamed ``forward`` (casting to the compute dtype when one is set), its ``state_dict`` hooks (the values
read from storage), and a guard on ``_apply`` (``.to()``, ``.half()``, ``.cuda()`` ...) of every module holding a
block.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ....errors import UnsupportedError
from ..storage import dtype_moves
from ..storage.loading import load_hooks
from ..storage.store import BlockStore
from .placeholders import internal
from .residency import Block

Run = Callable[[Block, Callable, tuple, dict], Any]  # runs a block's forward with its parameters resident

COMPILE_AROUND_WARNING = (
    "torch.compile of a model holding streamed blocks: each streamed block ({prefix} first) is a graph break and "
    "runs outside the compiled graph. The result equals, bit for bit, the same model in memory compiled with those "
    "blocks excluded (torch.compiler.disable on each block's forward); it is not the model compiled whole, whose "
    "fusions across the blocks may round differently. To compile the blocks themselves, call block.compile() on "
    "each streamed block (bit-identical to block.compile() in memory)."
)


def refuse_cuda_graphs(block: Block, kwargs: dict) -> None:
    """Refuse ``block.compile()`` options that record CUDA graphs (untested with parameters that move).

    Raises:
        UnsupportedError: For ``mode="reduce-overhead"`` or ``"max-autotune"``, or ``options={"triton.cudagraphs":
            True}``.
    """
    options = kwargs.get("options") or {}
    if kwargs.get("mode") in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        raise UnsupportedError(
            f"block {block.prefix}: compile() with CUDA graphs (mode={kwargs.get('mode')!r}) replays kernels on "
            f"fixed parameter addresses, and a streamed block's parameters get new memory each time it is read; "
            f"this is not tested to be exact. Use the default mode (mode='default')"
        )


def _casting(forward: Callable, dtype: torch.dtype) -> Callable:
    """``forward`` computing in ``dtype``, so an fp32 model can stream blocks computing in bf16.

    Args:
        forward: The block's forward.
        dtype: The compute dtype.

    Returns:
        A forward that casts its floating-point tensor arguments to ``dtype`` and its ``dtype`` outputs back to the
        dtype of its first floating-point argument.
    """

    def cast(x: Any, to: torch.dtype, only: torch.dtype | None = None) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and (only is None or x.dtype == only):
            return x.to(to)
        return x

    def run(*args, **kwargs):
        flat = pytree.tree_leaves((args, kwargs))
        outer = next((x.dtype for x in flat if isinstance(x, torch.Tensor) and x.is_floating_point()), dtype)
        args, kwargs = pytree.tree_map(lambda x: cast(x, dtype), (args, kwargs))
        return pytree.tree_map(lambda x: cast(x, outer, only=dtype), forward(*args, **kwargs))

    return run


class ModulePatches:
    """The patches on ``module`` and its ``blocks``: ``stream``, ``guard_moves`` put them on, ``remove`` takes them off.

    Args:
        module: The user's model.
        blocks: Its streamed blocks.
        store: The blocks' store (read by the ``state_dict`` and load hooks, written by dtype moves).
        run: Called for every call of a streamed block.
        moved: Called after blocks were converted to another dtype.
    """

    def __init__(self, module: nn.Module, blocks: list[Block], store: BlockStore, run: Run, moved: Callable[[], None]):
        self.module, self.blocks, self.store, self.run, self.moved = module, blocks, store, run, moved
        self.patched: list[tuple[nn.Module, str, Callable]] = []
        self.hooks: list = []
        self.warned_compiled = False
        self.compiled: dict[nn.Module, tuple[tuple, dict]] = {}  # blocks compile() was called on: its arguments

    def _run_in_compiled(self, block: Block, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """Run ``block`` called from code ``torch.compile`` compiled, warning once what that result equals."""
        if not self.warned_compiled:
            import warnings

            self.warned_compiled = True
            warnings.warn(COMPILE_AROUND_WARNING.format(prefix=block.prefix), UserWarning, stacklevel=3)
        return self.run(block, forward, args, kwargs)

    def stream(self, block: Block) -> None:
        """Replace the block's ``forward`` by one that streams it, and hook its ``state_dict``."""
        forward = block.module.forward
        if block.compute_dtype is not None:
            forward = _casting(forward, block.compute_dtype)
        run = self.run
        current = [forward]  # the forward the block runs with its parameters resident: compiled by compile()

        def streamed_forward(*args, **kwargs):
            if torch.compiler.is_compiling():
                # torch.compile of a module holding the block: the block is a graph break and runs outside that
                # graph (its parameters change as they are streamed); the compiler is imported only by then
                # (importing it costs about 90 MB)
                return torch.compiler.disable(self._run_in_compiled)(block, current[0], args, kwargs)
            return run(block, current[0], args, kwargs)

        def compile(*args, **kwargs) -> None:  # noqa: A001 - nn.Module.compile, for this block
            refuse_cuda_graphs(block, kwargs)
            current[0] = torch.compile(forward, *args, **kwargs)
            self.compiled[block.module] = (args, kwargs)  # close() compiles the block itself with them

        block.module.forward = streamed_forward
        block.module.compile = compile  # type: ignore[method-assign]
        self.patched.append((block.module, "forward", streamed_forward))
        self.patched.append((block.module, "compile", compile))
        self.hooks.append(block.module.register_state_dict_pre_hook(self._block_state_dict_start(block)))
        self.hooks.append(block.module.register_state_dict_post_hook(self._block_state_dict(block)))
        load, loaded = load_hooks(self.store, block)
        self.hooks.append(block.module.register_load_state_dict_pre_hook(load))
        self.hooks.append(block.module.register_load_state_dict_post_hook(loaded))

    @staticmethod
    def _block_state_dict_start(block: Block) -> Callable:
        def hook(module, prefix, keep_vars) -> None:
            block.exporting += 1  # its parameters' detach() is allowed until the post hook replaces the results

        return hook

    def _block_state_dict(self, block: Block) -> Callable:
        def hook(module, state_dict, prefix, local_metadata) -> None:
            # the block's parameters as stored (master values), read block by block when on storage
            block.exporting = max(block.exporting - 1, 0)
            with internal():
                self.store.wait_write(block)
                copies = self.store.read_copy(block)
            now = block.names_now()  # (an adapter layer may have moved a parameter: PEFT's base_layer)
            for name, tensor in copies.items():
                if prefix + now[name] in state_dict:
                    state_dict[prefix + now[name]] = tensor

        return hook

    def guard_moves(self) -> None:
        """Guard ``_apply`` of the module and of every module holding a block.

        On ``model.to(dtype)``, ``.half()``, ``.double()``, ``.cuda()`` ... the blocks' stored values are converted
        first, block by block, or the move is refused before anything is converted (``dtype_moves``).
        """
        holders = set()
        for name, _ in ((b.prefix, b) for b in self.blocks):
            parts = name.split(".") if name else []
            for k in range(len(parts) + 1):
                holders.add(".".join(parts[:k]))
        for name, sub in self.module.named_modules():
            if name in holders:
                original = sub._apply

                def guarded(fn, recurse=True, _original=original):
                    with internal():
                        self._move(fn)
                        return _original(fn, recurse)

                sub._apply = guarded
                self.patched.append((sub, "_apply", guarded))

    def _move(self, fn: Callable) -> None:
        todo = dtype_moves.planned(self.blocks, fn)
        if todo:
            dtype_moves.convert(self.store, todo, fn)
            self.moved()

    def remove(self, restore: bool) -> None:
        """Take the hooks and patches off.

        Args:
            restore: Whether the blocks get their own ``forward`` back; if not, they keep their streamed ``forward``
                (calls keep failing with a clear error).
        """
        for hook in self.hooks:
            hook.remove()
        for module, attribute, patched in self.patched:
            if attribute == "forward" and not restore:
                continue  # calls keep failing with a clear error
            if module.__dict__.get(attribute) is patched:
                delattr(module, attribute)
        if restore:
            for module, (args, kwargs) in self.compiled.items():
                module.compile(*args, **kwargs)  # nn.Module.compile: in memory, the block stays compiled
