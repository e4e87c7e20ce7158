"""Storage layouts: where a ``TensorSwapper``'s records live (``StorageLayout``), one file per layout, registered.

Built in: ``folder`` (``one_folder.py``: one run folder) and ``drives`` (``multi_folder.py``: a run folder on each of
several drives). ``SwapConfig(layout=name)`` selects one by name; to add one, write a ``StorageLayout`` subclass
in a file of its own and decorate it with ``register_layout(name)``.
"""

from __future__ import annotations

from . import one_folder as one_folder  # first: the default, first in every list  # isort: skip
from . import multi_folder as multi_folder  # isort: skip
from .base import LayoutSettings, StorageLayout
from .registry import layout_class, layout_names, register_layout, unregister_layout

__all__ = ["LayoutSettings", "StorageLayout", "layout_class", "layout_names", "register_layout", "unregister_layout"]
