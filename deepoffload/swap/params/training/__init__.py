"""How streamed blocks are trained.

The training modes (fused, grads) and what they share, the step after backward, data-parallel gradient averaging, and
the optimizer-shaped view for training loops.
"""
