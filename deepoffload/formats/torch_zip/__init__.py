"""``torch.save``'s zip format moved through the async-IO op: streams, whole-file reads, record checks and writing.

The layer below ``deepoffload.checkpoint`` (``save``/``load``) and the ``torch.save`` checkpoint format.
"""
