"""Where a block's bytes live and how they move.

The ``BlockStore`` (reads, writes, pinning), the values user code changes in a block, ``load_state_dict`` and dtype
moves of stored blocks, the state streamed out for ``save``, and the end of an offload.
"""
