"""Build step of zbccl's wheel: the native libraries, prebuilt into the package.

Everything else is declared in pyproject.toml. ``build_py`` compiles each library of
``zbccl.native.LIBRARIES`` with the JIT cache's own recipe (``zbccl.native.build.compile_into``: the same
flags, the generated ``zb_abi.h``) into ``zbccl/native/_prebuilt/<name>/`` and writes the manifest the
loader checks (``zbccl/native/prebuilt.py``). The core is a CPython extension against this Python; the
allocator hook and the hot entry link torch's C++ API, so they are built against the torch of the build
environment (pinned in ``[build-system] requires``) and recorded with its version: under another torch
the loader rebuilds them in the JIT cache instead of loading them.

The core links OpenMP; the ``libgomp.so.1`` the compiler links is copied beside it (``$ORIGIN``
rpath) so that a machine without the compiler's runtime loads it, as ``auditwheel repair`` would.

An editable install (``pip install -e``) builds nothing: the JIT cache serves the checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _zbccl_native():
    """``zbccl.native`` of this source tree (one recipe for the wheel and the JIT cache), imported
    without ``zbccl/__init__.py``: the build needs torch (for the torch-linked libraries) but not numpy."""
    if "zbccl" not in sys.modules:
        pkg = types.ModuleType("zbccl")
        pkg.__path__ = [str(ROOT / "src" / "zbccl")]
        sys.modules["zbccl"] = pkg
    import zbccl.native
    from zbccl._version import __version__

    return zbccl.native, __version__


class BinaryDistribution(Distribution):
    """The wheel holds native code: tag it for this Python and platform, not ``py3-none-any``."""

    def has_ext_modules(self) -> bool:
        return True


def _libgomp(compiler: str) -> Path | None:
    try:
        out = subprocess.run([compiler, "-print-file-name=libgomp.so.1"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(out)
    return path.resolve() if path.is_absolute() and path.exists() else None


class BuildPyWithNative(build_py):
    """``build_py``, then the native libraries and their manifest into the build tree."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        self._build_native(Path(self.build_lib) / "zbccl" / "native" / "_prebuilt")

    def _build_native(self, out: Path) -> None:
        native, version = _zbccl_native()
        nb, prebuilt = native.build, native.prebuilt

        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        libraries = {}
        for name in native.LIBRARIES:
            base = native.spec(name)
            compiler = nb.find_compiler(base.lang)
            rpath = ("-Wl,-rpath,$ORIGIN",) if name == "core" else ()
            spec = nb.BuildSpec(base.name, base.sources, base.lang, base.torch, base.flags + rpath, compiler,
                                base.generated)
            directory = out / name
            directory.mkdir()
            print(f"zbccl: compiling {name} for the wheel", flush=True)
            lib = nb.compile_into(spec, directory)
            for header, _ in base.generated:  # build inputs only
                (directory / header).unlink()
            if name == "core":
                gomp = _libgomp(compiler)
                if gomp is not None:
                    shutil.copy2(gomp, directory / "libgomp.so.1")
            libraries[name] = prebuilt.entry(name, f"{name}/{lib.name}", nb.source_key(base),
                                             nb.torch_tag() if base.torch else None)
        manifest = {"format": prebuilt.FORMAT, "zbccl": version, "abi": nb.abi_tag(), "libraries": libraries}
        (out / prebuilt.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithNative})
