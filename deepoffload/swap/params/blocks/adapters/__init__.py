"""Block adapters: how a model's blocks are found and what a block is made of, one file per kind of model.

``find_blocks`` walks the model from the top and asks the registered adapters, newest first, about each module it
meets (``BlockAdapter.children``); the first that knows the module says which of its children are blocks and which to
look inside. When ``ParameterOffload`` sets a block up, it asks the adapters which parameters the block streams
(``BlockAdapter.parameters``). ``sequences`` (the children of ``nn.ModuleList`` and ``nn.Sequential``) is always
registered, last. To teach deepoffload a new kind of model, write one adapter and register it::

    register_adapter(MyAdapter())  # consulted before the ones registered earlier
    ...
    unregister_adapter(MyAdapter.name)
"""

from .protocol import BlockAdapter, Child
from .registry import adapters, find_blocks, register_adapter, streamed_parameters, unregister_adapter

__all__ = [
    "BlockAdapter",
    "Child",
    "adapters",
    "find_blocks",
    "register_adapter",
    "streamed_parameters",
    "unregister_adapter",
]
