# For mypy only. op_builder/ is installed as deepoffload.op_builder (setup.py's package_dir; deepoffload/_link.py
# loads it under that name in a bare checkout), which mypy cannot see: it checks op_builder/ as its own top-level
# package. These stubs (on mypy_path, see pyproject.toml [tool.mypy]) re-export each module under its installed name,
# so deepoffload's calls into it are checked against the real code. A module missing here is an import-not-found.
from op_builder import *  # noqa: F403
