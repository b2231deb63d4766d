"""zbccl's native code: the C core (atomics, waits, copies) and the CPU allocator hook.

Nothing is built or loaded at import. :func:`core` and :func:`alloc_hook`
build on first use (cached across processes, see :mod:`zbccl.native.build`)
and then return the same loaded object for the life of the process.

* ``core``: a CPython extension module ``zbccl._native_core`` (METH_FASTCALL). Its struct layout
  (``abi_layout()``) is compared with :mod:`.abi` when it loads.
* ``cpu_alloc_hook``: a plain C++ library against ``libc10``, loaded with
  ctypes; it is never unloaded because torch keeps a pointer to its allocator.
* ``hot``: a CPython extension module ``zbccl._native_hot`` against torch's C++ API
  (``libtorch_python``): the all_reduce entry that takes the tensor itself (``csrc/hot.cpp``).
  Optional: :func:`hot` returns None when it cannot be built, and the Python path serves.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ZbcclSystemError
from . import abi
from . import build as _b  # the package attribute ``build`` stays the module

__all__ = ["GENERATED", "LIBRARIES", "alloc_hook", "build_all", "core", "hot", "status"]

_CSRC = Path(__file__).parent / "csrc"

#: name -> (sources, lang, torch[, extra flags]): the libraries zbccl builds. Headers
#: are listed too: they are hashed into the cache key but not compiled. The core also
#: includes ``zb_abi.h``, generated from :mod:`.abi` (see :data:`GENERATED`).
LIBRARIES: dict[str, tuple] = {
    "core": ((_CSRC / "core.c", _CSRC / "reduce.c", _CSRC / "reduce_simd.c", _CSRC / "reduce_py.c", _CSRC / "chan.c",
              _CSRC / "chan_ops.c", _CSRC / "ep.c", _CSRC / "reduce.h", _CSRC / "chan.h", _CSRC / "arch.h"), "c", False,
             ("-fopenmp",)),
    "cpu_alloc_hook": ((_CSRC / "cpu_alloc_hook.cpp",), "c++", True),
    "hot": ((_CSRC / "hot.cpp",), "c++", True,
            (f"-I{sysconfig.get_paths()['include']}", "-Wl,--no-as-needed", "-ltorch_python")),
}

#: name -> generated headers ``(file name, text)`` of that library.
GENERATED: dict[str, tuple[tuple[str, str], ...]] = {"core": (("zb_abi.h", abi.c_header()),),
                                                     "cpu_alloc_hook": (("zb_hook_abi.h", abi.hook_header()),)}

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def _build(name: str) -> Path:
    sources, lang, torch, *rest = LIBRARIES[name]
    flags = tuple(rest[0]) if rest else ()
    return _b.build(name, list(sources), lang=lang, torch=torch, extra_flags=flags,  # type: ignore[arg-type]
                    generated=GENERATED.get(name, ()))


def _load_core(path: Path, modname: str = "zbccl._native_core") -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(modname, str(path))
    spec = importlib.util.spec_from_file_location(modname, str(path), loader=loader)
    if spec is None:
        raise ZbcclSystemError(f"native: cannot load {path}, expected an extension module")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[modname] = module
    return module


def core() -> ModuleType:
    """The native core module (built on first use, then cached for the process).

    Functions: ``load_acquire(addr)``, ``store_release(addr, v)``,
    ``fetch_add(addr, d)``, ``signal(addr, v)``, ``fetch_add_signal(addr, d)``,
    ``wait_ge(addrs_ptr, n, target, spin, budget_ns)``,
    ``wait_eq(addr, v, spin, budget_ns)``, ``now_ns()``,
    ``memcpy(dst, src, n)``, ``memset(dst, byte, n)``. See ``csrc/core.c``.
    """
    mod = _loaded.get("core")
    if mod is None:
        with _lock:
            mod = _loaded.get("core")
            if mod is None:
                mod = _load_core(_build("core"))
                wrong = abi.check_layout(mod.abi_layout())
                if wrong:  # a core built from other sources than this abi.py: never run it
                    raise ZbcclSystemError(f"native: the core's ABI does not match zbccl/native/abi.py: {wrong}; "
                                           "rebuild it ('zbccl build')")
                _loaded["core"] = mod
    return mod


def alloc_hook() -> ctypes.CDLL:
    """The ctypes handle of the CPU allocator hook library (imports torch first).

    Only loads it; installing it as torch's CPU allocator is
    :mod:`zbccl.adapters.scope`'s job.
    """
    lib = _loaded.get("cpu_alloc_hook")
    if lib is None:
        with _lock:
            lib = _loaded.get("cpu_alloc_hook")
            if lib is None:
                import torch  # noqa: F401  (libc10 must be loaded before the hook)

                lib = _loaded["cpu_alloc_hook"] = ctypes.CDLL(str(_build("cpu_alloc_hook")))
    return lib


def hot() -> ModuleType | None:
    """The native hot-entry module (built on first use), or None where it cannot be built or loaded
    (no C++ compiler, torch without its headers): the Python path then serves every call."""
    if "hot" not in _loaded:
        with _lock:
            if "hot" not in _loaded:
                try:
                    import torch  # noqa: F401  (libtorch_python must be loaded first)

                    _loaded["hot"] = _load_core(_build("hot"), "zbccl._native_hot")
                except Exception as exc:  # noqa: BLE001 - optional: the Python path does the same
                    logging.getLogger("zbccl").info("zbccl: native hot entry unavailable (%s)", exc)
                    _loaded["hot"] = None
    return _loaded["hot"]


def build_all() -> dict[str, Path]:
    """Build every library now (``zbccl build``, ``make``); returns name -> path."""
    return {name: _build(name) for name in LIBRARIES}


def status() -> dict[str, dict[str, Any]]:
    """For ``zbccl info``: per library, whether it is built, where, how long it took, with what.

    Never compiles; runs the compiler's ``--version`` once to find the key.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, (sources, lang, torch, *rest) in LIBRARIES.items():
        row: dict[str, Any] = {"built": False, "loaded": name in _loaded}
        flags = tuple(rest[0]) if rest else ()
        try:
            spec = _b.BuildSpec(name, sources, lang, torch, flags, _b.find_compiler(lang),  # type: ignore[arg-type]
                                GENERATED.get(name, ()))
            directory = _b.cache_path(spec)
        except Exception as exc:  # a missing compiler or torch is a status, not a crash
            row["error"] = str(exc)
            out[name] = row
            continue
        lib = directory / _b.lib_filename(name)
        info = _b.read_build_info(directory) if lib.exists() else {}
        row.update(
            built=lib.exists(),
            path=str(lib),
            build_seconds=info.get("seconds"),
            compiler=info.get("compiler", spec.compiler),
        )
        out[name] = row
    return out
