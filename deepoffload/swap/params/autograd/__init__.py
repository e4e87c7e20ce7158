"""The autograd replay of a streamed block.

The function that recomputes a block in backward, the state its forward ran under, the side effects the recompute must
not repeat, and tensors passed to several blocks.
"""
