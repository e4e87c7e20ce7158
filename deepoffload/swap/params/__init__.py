"""Parameter offload: run and train models larger than memory by streaming blocks of parameters from storage.

``offload_parameters(module, ...)`` writes the parameters of chosen submodules ("blocks") to files and frees their
memory; each parameter keeps its identity but holds a 0-element placeholder of its dtype and device while it is on
storage (its shape lives in the swap record). A block's parameters are read back just before the block runs (the
next ``prefetch`` blocks are read meanwhile) and released right after.

Blocks (default rule): the children of every ``nn.ModuleList`` / ``nn.Sequential`` found by walking the module from
the top (the module itself included), not looking inside a block once chosen; children without parameters are
skipped. Blocks are expected to run in that order (prefetch follows it; another order is still correct, only slower).
Parameters outside blocks (embeddings, heads, norms) and all buffers stay in memory. A parameter may not be shared
between two blocks or between a block and the rest; one module placed twice (``nn.Sequential(layer, other, layer)``)
is one block, run twice.

Inference (grad disabled, or nothing needs a gradient): the block's own ``forward`` runs on the resident parameters,
so outputs are bit-identical to the in-memory model
(``tests/swap/params/test_params_inference.py::test_outputs_identical_to_in_memory``).

Training uses recomputation (what ZeRO-Infinity does with activation checkpointing): each block runs inside a custom
autograd function that keeps only the block's inputs; backward reads the parameters again (prefetching earlier
blocks in reverse order), restores the RNG state, recomputes the block with gradients enabled and back-propagates
through it. The forward runs under the same grad mode as the in-memory model, so the same kernels are chosen and
results are bit-identical to in-memory training with the same optimizer (on deterministic kernels;
``tests/swap/params/test_params_training.py::test_training_bit_identical_to_in_memory``). Each block costs
one extra forward. Backward with ``retain_graph``/``create_graph`` through a block is not supported.

The recomputation repeats none of the forward's side effects (``side_effects``): it runs on the block's buffers as
they were before the forward (BatchNorm statistics, counters) and puts back what the forward left, under the
forward's RNG state, and with a Hugging Face ``DynamicCache`` argument rewound to its state before the forward (the
entries the forward added are detached from the block's graph); caches updated in place (``StaticCache``) are
refused in a forward with gradients enabled. A block's gradients are complete when no other of its calls will be
back-propagated in the backward under way (asked of the autograd engine), so blocks called out of order (0, 1, 0),
inside ``torch.utils.checkpoint`` (either kind), or forwards that are never back-propagated (validation without
``torch.no_grad()``) step exactly once. A reentrant checkpoint back-propagates each call of a block in a nested
pass of its own, which cannot tell whether another call of the block is still to come: in fused mode such blocks
keep their gradients in memory and step in ``step()`` (``use_reentrant=False`` keeps fused mode memory-minimal).
Backward through a forward made before the block's last optimizer step is refused (RuntimeError), as is a block's
backward without ``optimizer=`` when its parameters need gradients; the forward itself works (an eval call without
``torch.no_grad()``).

Gradients never pile up. Once a block's gradients are complete (after its last backward in the pass):
- ``mode="fused"`` (memory-minimal): the block's optimizer step runs right away inside backward, its optimizer state
  read from and written back to storage (``OffloadedOptimizer``), the updated weights are written back and the
  gradients freed. The block's state is read while its backward runs. One backward per step (no gradient
  accumulation: a second backward pass before ``step()`` raises RuntimeError) and no clipping by a global norm
  (``step(clip_grad_norm=...)`` raises ValueError): each block steps before the others' gradients exist.
  Per-parameter optimizers (Adam, AdamW, SGD, ...) give exactly the same result as a global step.
- ``mode="grads"``: the block's gradients go to storage (accumulating over several backward passes, in the master
  dtype); ``step()`` then streams block by block: weights and gradients in, optimizer step, weights out.
  ``step(clip_grad_norm=max_norm, norm_type=2.0)`` clips by the global norm in two passes: first the blocks'
  gradients are streamed in (``prefetch`` blocks ahead, pooled buffers) for their norms, which join those of the
  gradients outside blocks; then the step pass multiplies each gradient by ``min(max_norm / (norm + 1e-6), 1)``
  before stepping. Same arithmetic and order as ``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm,
  norm_type)`` on the master-dtype gradients (``grad_norm``), so bit-identical
  (``tests/swap/params/test_params_clipping.py::test_clipped_training_bit_identical_to_in_memory``); it returns the
  total norm. Cost: one more read of the gradients.
``step()`` also steps the parameters outside blocks (their state offloaded too); call it after each backward.

Mixed precision (``compute_dtype``): the stored parameters are the master weights (their dtype, e.g. fp32); blocks
compute with a copy cast to ``compute_dtype`` (e.g. bf16) whose gradients are cast back to the master dtype for the
step. Parameters report ``compute_dtype`` while offloaded; a block casts its floating-point inputs to
``compute_dtype`` and its ``compute_dtype`` outputs back to the dtype of its first floating-point input, so an fp32
model streams bf16 blocks. Buffers keep their dtype; submodules holding floating-point buffers of another dtype
(BatchNorm's running statistics) keep their parameters in the master dtype and run in mixed precision, as
``torch.autocast`` runs them.

Checkpoints and the model's lifetime: ``module.state_dict()`` (hence ``save_pretrained``) holds the blocks' real
weights, read from storage one block at a time (copies, master dtype). While a block is not in memory its parameters are
``StreamedParameter`` (``placeholders``): shapes and counts are the stored ones, and code that would see the
placeholders (copies or saves parameter by parameter, writes, optimizers over ``model.parameters()``, ``p.grad`` between
backward and ``step()``) raises at once saying what to use instead. ``close()`` reads every block back into memory by
default (``close(restore=False)`` discards them). ``model.load_state_dict`` writes each block's entries to its stored
values (``loading``). Dtype moves (``model.to(dtype)``, ``.half()``, ``.double()`` ... on the module or any module
holding a block) convert the stored blocks one at a time (``dtype_moves``); device moves of streamed parameters raise
ValueError before anything is converted. Parameters added or replaced after offloading are refused at the next forward
(``structure``). A block's recompute runs under its forward's autocast, RNG and kernel settings (``forward_state``);
in grads mode a ``GradScaler`` unscales and checks the stored gradients in ``scaler.step(StreamedOptimizer(off))``
(``training.scaling``), so fp16 autocast trains as in memory; fused mode steps blocks inside backward, so fp16
autocast training and an enabled ``GradScaler``'s ``scale()`` are refused there (``refusals.scaled_loss_error``,
before that backward: with ``compute_dtype`` it stepped the blocks on scaled gradients). ``torch.compile(model)``
compiles around the streamed blocks (each a graph break, run outside the graph: equal to the model in memory compiled
with its blocks excluded, with a warning saying so); ``block.compile()`` on a streamed block compiles its forward, run
with the parameters resident (``patches``). ``transformers.Trainer``: ``deepoffload.trainer_arguments``
(``integrations/hugging_face/trainer.py``).

Layout, by job: ``api`` (``offload_parameters``, the public entry point), ``offload`` (``ParameterOffload``, what it
returns), ``stats`` (``OffloadStats``), ``budget`` (the memory plan); ``blocks/`` (``finding``: the default block
rule; ``residency``: each block's state with checked transitions; ``placeholders``: what a parameter is while its
block is not in memory; ``schedule``: prefetch order; ``patches``: what is attached to the user's modules);
``storage/`` (``store``: the blocks' IO as residency moves; ``user_changes``, ``loading``, ``dtype_moves``,
``export``, ``closing``); ``training/`` (``modes``: the fused mode and the modes' table; ``base``: what both modes
share; ``grads``: the grads mode and clipping; ``stepping``; ``data_parallel``; ``streamed_optimizer``: an
optimizer-shaped view for training loops such as ``transformers.Trainer``); ``autograd/`` (``recompute``: the
autograd function; ``forward_state``; ``side_effects``: what recomputation must not repeat; ``shared_inputs``);
``setup/`` (``materialize``: a model built on ``meta`` made block by block from a checkpoint or an initializer,
straight to storage; ``init_policy``, ``deferred_init``, ``model_rules``: a family's checkpoint names, float32
parameters, tying, initializer and caches, asked of a registry); ``guards/`` (``refusals``, ``structure``,
``wrappers``: DDP and FSDP2 around a streamed model, refused). ``from_pretrained``, ``trainer_arguments`` and the
Hugging Face model rules live in ``deepoffload/integrations/hugging_face/``.
"""

from .api import offload_parameters
from .blocks.finding import find_blocks
from .blocks.placeholders import StreamedParameter
from .blocks.residency import Residency, ResidencyError
from .offload import MODES, OptimizerFactory, ParameterOffload
from .stats import OffloadStats
from .training.streamed_optimizer import StreamedOptimizer

__all__ = [
    "MODES",
    "OffloadStats",
    "OptimizerFactory",
    "ParameterOffload",
    "Residency",
    "ResidencyError",
    "StreamedOptimizer",
    "StreamedParameter",
    "find_blocks",
    "offload_parameters",
]
