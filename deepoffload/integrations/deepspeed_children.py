"""``enable()`` in DeepSpeed's child processes, which do not see an ``enable()`` made in their parent.

``ds_nvme_tune`` runs each ``ds_io`` measurement as a new process, and ``ds_io`` spawns its workers with
``multiprocessing``; none of them sees an ``enable()`` made in its parent.

``enable()`` sets ``DEEPOFFLOAD_DEEPSPEED=1`` in its process's environment, which children inherit. The package
installs ``deepoffload-deepspeed.pth`` into site-packages; Python runs its one line at every start. With the variable
unset that line only reads the environment (nothing is imported); with it set to ``1`` it calls ``install()``, which
calls ``enable()`` as soon as the process has imported ``deepspeed`` (at once if it already has). Users can also set
the variable themselves: ``DEEPOFFLOAD_DEEPSPEED=1 ds_nvme_tune --nvme_dir ...`` runs the whole sweep on
deepoffload's op.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

from .deepspeed_env import ENV, mark_children, unmark_children  # noqa: F401 (re-exported)

PTH_NAME = "deepoffload-deepspeed.pth"
# The .pth line: cheap and inert unless the variable is "1" (site runs lines that start with "import"). A plain
# literal: setup.py reads it (and PTH_NAME) from this file's syntax tree, without importing the package.
PTH_LINE = (
    "import os; os.environ.get('DEEPOFFLOAD_DEEPSPEED') == '1' and "
    "__import__('deepoffload.integrations.deepspeed_children', fromlist=['install']).install()"
)

_lock = threading.Lock()
_finder: _EnableAfterImport | None = None


def install() -> None:
    """Calls ``deepoffload.integrations.deepspeed.enable()`` once ``deepspeed`` is imported (now, if it already is).

    An error of ``enable()`` propagates from ``import deepspeed``: the process was asked to run on deepoffload's op
    and must not measure or train on another one silently.
    """
    global _finder
    if "deepspeed" in sys.modules:
        _enable()
        return
    with _lock:
        if _finder is None:
            _finder = _EnableAfterImport()
            sys.meta_path.insert(0, _finder)


def _enable() -> None:
    from .deepspeed import enable

    enable()


class _EnableAfterImport(importlib.abc.MetaPathFinder):
    """An import hook that calls ``enable()`` right after DeepSpeed's ``__init__`` ran.

    It finds nothing itself: on the first import of ``deepspeed`` it removes itself, finds the real spec and makes
    its loader call ``enable()`` after DeepSpeed's ``__init__`` ran.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        global _finder
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _finder = None
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_enable(module):
            exec_module(module)
            _enable()

        spec.loader.exec_module = exec_then_enable  # this spec's loader only: the import proceeds as usual
        return spec
