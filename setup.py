"""Installs deepoffload without compiling anything, unless asked to prebuild the native ops.

The C++ sources (csrc/) and the op builders (op_builder/) ship inside the package as ``deepoffload/csrc`` and
``deepoffload.op_builder``, so a non-editable install can still build the op just in time.

Prebuilding: ``DEEPOFFLOAD_BUILD_OPS=1`` (every op) or ``DEEPOFFLOAD_BUILD_AIO=1`` compiles the async-IO op into the
package. It needs torch installed, so use ``pip install --no-build-isolation .`` (or ``pip wheel
--no-build-isolation``). An op asked for that cannot be built fails the install with the probe's reason.
"""

import json
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

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
        sys.exit("deepoffload: prebuilding ops needs torch installed first; then install with "
                 "`pip install --no-build-isolation .`")
    import op_builder
    from op_builder.builder import CXX_PROBE, python_abi

    builder = op_builder.AsyncIOBuilder()
    results = builder.probe_results(use_cache=False)
    if not results[CXX_PROBE.name].ok:
        r = results[CXX_PROBE.name]
        sys.exit(f"deepoffload: DEEPOFFLOAD_BUILD_AIO was requested but the async_io op cannot be built here: "
                 f"{r.reason}\n  " + "\n  ".join(r.output_tail))
    cflags, ldflags = builder.build_flags(results)
    sources = [str(p.relative_to(ROOT)) for p in builder.source_files()]
    info = {
        "torch": torch.__version__,
        "python": python_abi(),
        "deepoffload": __version__,
        "ops": {builder.NAME: {
            "module": builder.MODULE,
            "engines": builder.engines(results),
            "cflags": cflags,
            "ldflags": ldflags,
            "probes": {name: r.to_json() for name, r in results.items()},
        }},
    }

    class BuildWithInfo(BuildExtension):
        def run(self):
            super().run()
            target = Path(self.build_lib if not self.inplace else ROOT) / "deepoffload" / "_ops" / "build_info.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(info, indent=1))

    # A plain Extension, not CppExtension: the op uses pybind11 (from torch's headers) and no torch library, and
    # CppExtension would link libc10/libtorch, which then must be loaded (import torch) before the op can be.
    extension = Extension(f"deepoffload._ops.{builder.MODULE}", sources, include_dirs=include_paths(),
                          extra_compile_args=cflags, extra_link_args=ldflags, language="c++")
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildWithInfo.with_options(use_ninja=True)}}


setup(
    name="deepoffload",
    version=__version__,
    description="Train and run PyTorch models larger than memory by streaming tensors to and from NVMe",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=[
        # every subpackage at any depth (deepoffload.swap.params is two levels down)
        *find_packages(where=str(ROOT), include=["deepoffload", "deepoffload.*"]),
        "deepoffload.op_builder",
        "deepoffload.csrc",
    ],
    package_dir={"deepoffload": "deepoffload", "deepoffload.op_builder": "op_builder", "deepoffload.csrc": "csrc"},
    # py.typed: the package's type hints are for type checkers too (PEP 561)
    package_data={"deepoffload": ["py.typed"], "deepoffload.csrc": ["aio/*.cpp", "aio/*.h"],
                  "deepoffload._ops": ["build_info.json", "deepoffload_aio.pyi"]},
    # tqdm: progress of demo/tune; xxhash: swap checksums (xxh3, several GB/s; a corrupted swap file is an error,
    # not a wrong result); numpy: torch does not require it but warns "Failed to initialize NumPy" on import without
    # it, so a plain install would print that warning in every command
    install_requires=["torch>=2.1", "ninja", "tqdm", "xxhash", "numpy"],
    # test: the suite, plus the projects whose own code proves the compatibility claims (pinned so CI is repeatable;
    # DeepSpeed with DS_ACCELERATOR=cpu, Hugging Face models built from configs, never downloaded)
    extras_require={
        "test": ["pytest", "hypothesis", "numpy", "deepspeed==0.19.8", "transformers==5.24.0", "safetensors==0.8.0",
                 "accelerate==1.15.0", "ruff==0.17.5", "mypy==2.4.1"],
        "deepspeed": ["deepspeed>=0.16"],
        "hf": ["transformers>=4.40", "safetensors"],
        "plot": ["matplotlib"],
        "fast": ["zlib-ng==1.1.0"],  # checkpoint CRC-32 several times faster than the standard library's zlib
    },
    entry_points={"console_scripts": ["deepoffload = deepoffload.cli.main:main"]},
    zip_safe=False,
    **prebuild_config(),
)
