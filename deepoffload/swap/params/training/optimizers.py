"""The optimizers of a ``ParameterOffload`` and which parameters they step.

One steps the blocks' master weights, one the parameters outside blocks, each with its state on storage.

A parameter frozen when they were made is in neither; ``check_unfrozen`` refuses a backward once such a parameter
requires a gradient, since no optimizer would step it (in memory, an optimizer over ``model.parameters()`` would).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ....errors import StreamedParameterError
from ...config import SwapConfig
from ...optimizer import OffloadedOptimizer
from ..blocks.residency import Block

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


class Optimizers:
    """The blocks' and the rest's ``OffloadedOptimizer`` (each None when it has nothing to step).

    Args:
        factory: Makes a torch optimizer over a list of parameters; None: inference only (no optimizer).
        blocks: The blocks; their master weights that require a gradient are stepped by ``block``.
        rest_named: The parameters outside blocks by qualified name; those requiring a gradient go to ``rest``.
        block_config: The async-IO settings of the blocks' optimizer state.
        rest_config: The async-IO settings of the rest's optimizer state.

    Raises:
        StreamedParameterError: When an optimizer is declared to read several parameters in one step.
    """

    def __init__(
        self,
        factory: OptimizerFactory | None,
        blocks: list[Block],
        rest_named: list[tuple[str, nn.Parameter]],
        block_config: SwapConfig,
        rest_config: SwapConfig,
    ):
        self.block: OffloadedOptimizer | None = None
        self.rest: OffloadedOptimizer | None = None
        if factory is not None:
            masters = [m for b in blocks for m in b.masters if m.requires_grad]
            self.block = OffloadedOptimizer(factory, masters, block_config) if masters else None
            if self.block is not None:  # stepped block by block, each block's state prefetched with the block: a
                # block's step reading its own state ahead again for the next step would read it twice and hold
                # the buffers through the next forward and backward
                self.block.read_ahead = False
            rest = [p for _, p in rest_named if p.requires_grad]
            self.rest = OffloadedOptimizer(factory, rest, rest_config) if rest else None
        check_per_parameter(self.all())
        self.training = factory is not None
        self.factory, self.rest_config = factory, rest_config
        self.rest_named = rest_named
        self.stepped_ids = optimized_ids(self.all())  # one frozen at this call and unfrozen later is not here

    def all(self) -> list[OffloadedOptimizer]:
        """The optimizers in use: the blocks', then the rest's."""
        return [o for o in (self.block, self.rest) if o is not None]

    def adopt(
        self, added: list[tuple[str, nn.Parameter]], rest: list[nn.Parameter], compute_dtype: torch.dtype | None
    ) -> None:
        """Step the adapter parameters ``added`` with the parameters outside the blocks, in memory.

        The rest's optimizer is made again over its parameters that require a gradient now and the trainable ones of
        ``added`` (appended to ``rest`` and ``rest_named``, which the other parts read), before any step.

        Args:
            added: The adapter parameters taken into the blocks since offloading, by qualified name.
            rest: The parameters outside the blocks (the list the step and the clipping read), extended in place.
            compute_dtype: The blocks' compute dtype (None: their own).

        Raises:
            StreamedParameterError: When an optimizer stepped already (the adapters would start mid-run), or the
                blocks compute in another dtype (the adapters, in memory, would compute in theirs).
        """
        if compute_dtype is not None:
            raise StreamedParameterError(
                f"adapter parameters (e.g. {added[0][0]}) were added after offload_parameters() with "
                f"compute_dtype={compute_dtype}: the blocks compute in it, the adapters (in memory) would not. "
                f"Use torch.autocast(dtype={compute_dtype}) instead of compute_dtype=, or add the adapters "
                f"before offload_parameters() (then they stream with the blocks)"
            )
        stepped = [o for o in self.all() if o.state_dict()["state"]]
        if stepped:
            raise StreamedParameterError(
                f"adapter parameters (e.g. {added[0][0]}) were added after the optimizers stepped: add adapters "
                f"(get_peft_model, PeftModel.from_pretrained) before the first step"
            )
        rest.extend(p for _, p in added)
        self.rest_named.extend(added)
        if self.factory is None:
            return
        if self.rest is not None:
            self.rest.close()
        params = [p for _, p in self.rest_named if p.requires_grad]
        self.rest = OffloadedOptimizer(self.factory, params, self.rest_config) if params else None
        check_per_parameter(self.all())
        self.stepped_ids = optimized_ids(self.all())

    def check_unfrozen(self, block: Block) -> None:
        """Refuse a backward once a parameter frozen when the optimizers were made requires a gradient.

        Args:
            block: The block whose backward is about to run (the parameters outside blocks are checked too).

        Raises:
            StreamedParameterError: When such a parameter requires a gradient (of ``block`` or outside the blocks).
        """
        if not self.training:
            return
        named = [
            (block.qualified(n), m) for n, p, m in zip(block.names, block.params, block.masters) if p.requires_grad
        ]
        named += [(n, p) for n, p in self.rest_named if p.requires_grad]
        for name, param in named:
            if id(param) not in self.stepped_ids:
                self.stepped_ids = optimized_ids(self.all())  # a param group added since?
            if id(param) not in self.stepped_ids:
                raise StreamedParameterError(
                    f"parameter {name} was frozen when offload_parameters() made the optimizers and "
                    f"requires a gradient now (requires_grad_(True) after it), so no optimizer would "
                    f"step it: unfreeze before offload_parameters() (freeze later instead: a frozen "
                    f"parameter gets no gradient and is not stepped), or offload again"
                )


def optimized_ids(optimizers: list[OffloadedOptimizer]) -> set[int]:
    """The identities of the parameters ``optimizers`` step (those of their param groups)."""
    return {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}


def check_per_parameter(optimizers: list[OffloadedOptimizer]) -> None:
    """Refuse an optimizer declared to read several parameters in one step (``per_parameter=False``).

    A ``ParameterOffload`` steps each block, and the parameters outside the blocks, in steps of their own. The
    optimizers are closed first.

    Args:
        optimizers: The block and rest optimizers just made.

    Raises:
        StreamedParameterError: When one is not per-parameter.
    """
    whole = [opt for opt in optimizers if not opt.per_parameter]
    if whole:
        for opt in optimizers:
            opt.close()
        raise StreamedParameterError(
            f"offload_parameters(train=TrainOptions(optimizer)): this {type(whole[0].optimizer).__name__} is "
            f"declared to read several "
            f"parameters in one step (deepoffload_per_parameter = False), but streamed blocks step block by block; "
            f"use an optimizer whose step reads each parameter alone (torch's built-in ones), or keep the model in "
            f"memory and put only its state on storage with OffloadedOptimizer(..., per_parameter=False)"
        )
