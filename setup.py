"""Installs deepoffload without compiling anything, unless asked to prebuild the native ops.

The C++ sources (csrc/) and the op builders (op_builder/) ship inside the package as ``deepoffload/csrc`` and
``deepoffload.op_builder``, so a non-editable install can still build the op just in time.

Prebuilding: ``DEEPOFFLOAD_BUILD_OPS=1`` (every op) or ``DEEPOFFLOAD_BUILD_AIO=1`` compiles the async-IO op into the
package. It needs torch installed, so use ``pip install --no-build-isolation .`` (or ``pip wheel
--no-build-isolation``). An op asked for that cannot be built fails the install with the probe's reason.
"""

import ast
import json
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

# op_builder is the lowest layer (stdlib only, imports nothing from deepoffload): setup.py uses it for the version and
# the prebuild, without importing deepoffload
from op_builder import env  # noqa: E402
from op_builder.builder import package_version  # noqa: E402

__version__ = package_version()


def requested_ops() -> list:
    try:
        requested = env.get("DEEPOFFLOAD_BUILD_OPS") or env.get("DEEPOFFLOAD_BUILD_AIO")
    except env.EnvError as e:
        sys.exit(f"deepoffload: {e}")
    return ["async_io"] if requested else []


def prebuild_config():
    """ext_modules and cmdclass for the requested ops (empty when none were requested)."""
    ops = requested_ops()
    if not ops:
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, include_paths
    except ImportError:
        sys.exit(
            "deepoffload: prebuilding ops needs torch installed first; then install with "
            "`pip install --no-build-isolation .`"
        )
    import op_builder
    from op_builder.builder import CXX_PROBE, python_abi

    builder = op_builder.AsyncIOBuilder()
    results = builder.probe_results(use_cache=False)
    if not results[CXX_PROBE.name].ok:
        r = results[CXX_PROBE.name]
        sys.exit(
            f"deepoffload: DEEPOFFLOAD_BUILD_AIO was requested but the async_io op cannot be built here: "
            f"{r.reason}\n  " + "\n  ".join(r.output_tail)
        )
    cflags, ldflags = builder.build_flags(results)
    sources = [str(p.relative_to(ROOT)) for p in builder.source_files()]
    info = {
        "torch": torch.__version__,
        "python": python_abi(),
        "deepoffload": __version__,
        "ops": {
            builder.NAME: {
                "module": builder.MODULE,
                "engines": builder.engines(results),
                "cflags": cflags,
                "ldflags": ldflags,
                "probes": {name: r.to_json() for name, r in results.items()},
            }
        },
    }

    class BuildWithInfo(BuildExtension):
        def run(self):
            super().run()
            target = Path(self.build_lib if not self.inplace else ROOT) / "deepoffload" / "_ops" / "build_info.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(info, indent=1))

    # A plain Extension, not CppExtension: the op uses pybind11 (from torch's headers) and no torch library, and
    # CppExtension would link libc10/libtorch, which then must be loaded (import torch) before the op can be.
    extension = Extension(
        f"deepoffload._ops.{builder.MODULE}",
        sources,
        include_dirs=include_paths(),
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        language="c++",
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildWithInfo.with_options(use_ninja=True)}}


def _children_hook() -> dict:
    """PTH_NAME and PTH_LINE of deepoffload/integrations/deepspeed_children.py (the .pth file and its line), read
    from its syntax tree: setup.py does not import the package."""
    path = ROOT / "deepoffload" / "integrations" / "deepspeed_children.py"
    values = {}
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in ("PTH_NAME", "PTH_LINE")
        ):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


class BuildPyWithPth(build_py):
    """Also writes the .pth line that lets DeepSpeed's child processes enable deepoffload's op (inert unless
    DEEPOFFLOAD_DEEPSPEED=1) at the top of the build, so it lands in site-packages."""

    def run(self):
        super().run()
        hook = _children_hook()
        target = Path(self.build_lib) / hook["PTH_NAME"]
        target.write_text(hook["PTH_LINE"] + "\n")

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / _children_hook()["PTH_NAME"])]


def cmdclass():
    prebuild = prebuild_config()
    return {**prebuild, "cmdclass": {"build_py": BuildPyWithPth, **prebuild.get("cmdclass", {})}}


setup(
    # The metadata (name, version, dependencies, extras, scripts) is in pyproject.toml. What stays here is what the
    # build needs beyond it: every subpackage at any depth (deepoffload.swap.params is two levels down), op_builder
    # and csrc mapped under deepoffload (a non-editable install builds the op just in time from them), and the
    # prebuilt extension when asked for.
    packages=[
        *find_packages(where=str(ROOT), include=["deepoffload", "deepoffload.*"]),
        "deepoffload.op_builder",
        "deepoffload.csrc",
    ],
    package_dir={"deepoffload": "deepoffload", "deepoffload.op_builder": "op_builder", "deepoffload.csrc": "csrc"},
    package_data={
        "deepoffload.csrc": ["aio/*.cpp", "aio/*.h"],
        "deepoffload._ops": ["build_info.json", "deepoffload_aio.pyi"],
        "deepoffload": ["py.typed"],
    },
    **cmdclass(),
)
