"""zbccl's native code: the C core (atomics, waits, copies) and the CPU allocator hook.

Nothing is built or loaded at import. ``zbccl.init`` calls :func:`prepare`, which
makes every library ready before the first op: the one a wheel carries
(:mod:`zbccl.native.prebuilt`, used only when its sources, Python ABI and torch
match), else a build in the JIT cache (:mod:`zbccl.native.build`; a source or
editable install, or a torch the wheel was not built for). :func:`core`,
:func:`alloc_hook` and :func:`hot` then return the same loaded object for the
life of the process.

* ``core``: a CPython extension module ``zbccl._native_core`` (METH_FASTCALL). Its struct layout
  (``abi_layout()``) is compared with :mod:`.abi` when it loads.
* ``cpu_alloc_hook``: a plain C++ library against ``libc10``, loaded with
  ctypes; it is never unloaded because torch keeps a pointer to its allocator.
* ``hot``: a CPython extension module ``zbccl._native_hot`` against torch's C++ API
  (``libtorch_python``): the all_reduce entry that takes the tensor itself (``csrc/py/hot.cpp``).
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
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import env
from ..errors import ZbcclSystemError
from . import abi, prebuilt
from . import build as _b  # the package attribute ``build`` stays the module

__all__ = ["GENERATED", "LIBRARIES", "TESTED_TORCH", "MIN_TORCH", "alloc_hook", "build_all", "check_torch", "core",
           "hot", "prepare", "spec", "status"]

#: torch releases a test suite ran on (major.minor): 2.13 (CPU) in CI. The GPU image's 2.11 (CUDA 13)
#: is in the declared range but has not run this suite yet, so it gets the untested warning too.
TESTED_TORCH = ("2.13",)
#: Below this torch, zbccl refuses to start: the process-group extension API it registers with
#: (``Backend.register_backend(..., extended_api=True, devices=...)``) and the float8 dtypes it maps.
MIN_TORCH = (2, 4)
_INSTALL_HINT = ("install a zbccl wheel built for this platform and Python (its libraries are prebuilt, torch "
                 "2.13), or a C and C++ compiler (e.g. apt-get install gcc g++) and run 'zbccl build'")

_CSRC = Path(__file__).parent / "csrc"
_CORE, _CPU, _PY = _CSRC / "core", _CSRC / "cpu", _CSRC / "py"

#: name -> (sources, lang, torch[, extra flags]): the libraries zbccl builds. Headers
#: are listed too: they are hashed into the cache key but not compiled. The core also
#: includes ``zb_abi.h``, generated from :mod:`.abi` (see :data:`GENERATED`). The native
#: code is in three layers: ``csrc/core`` (the protocol engine: pure C, no Python header,
#: over a transport's verbs, ``core/transport.h``), ``csrc/cpu`` (the CPU transport and its
#: kernels: flags, copies, reductions, EP rows, the allocator hook) and ``csrc/py`` (the
#: CPython bindings: argument parsing, the GIL, the modules).
LIBRARIES: dict[str, tuple] = {
    "core": ((_CORE / "chan.c", _CORE / "chan_ops.c", _CORE / "kind.c", _CPU / "flags.c", _CPU / "transport.c",
              _CPU / "reduce.c", _CPU / "reduce_simd.c", _CPU / "ep.c", _PY / "module.c", _PY / "chan_py.c",
              _PY / "reduce_py.c", _PY / "ep_py.c", _CORE / "chan.h", _CORE / "transport.h", _CORE / "arch.h",
              _CPU / "flags.h", _CPU / "reduce.h", _CPU / "ep.h", _CPU / "transport_cpu.h"), "c", False,
             ("-fopenmp",)),
    "cpu_alloc_hook": ((_CPU / "cpu_alloc_hook.cpp",), "c++", True),
    "hot": ((_PY / "hot.cpp",), "c++", True,
            (f"-I{sysconfig.get_paths()['include']}", "-Wl,--no-as-needed", "-ltorch_python")),
}

#: name -> generated headers ``(file name, text)`` of that library.
GENERATED: dict[str, tuple[tuple[str, str], ...]] = {"core": (("zb_abi.h", abi.c_header()),),
                                                     "cpu_alloc_hook": (("zb_hook_abi.h", abi.hook_header()),),
                                                     "hot": (("zb_abi.h", abi.c_header()),)}

_lock = threading.Lock()
_loaded: dict[str, Any] = {}
#: name -> where the loaded library came from ("prebuilt" or "cache"); name -> why it is unavailable.
_origin: dict[str, str] = {}
_failed: dict[str, str] = {}
_torch_checked = False


def spec(name: str, compiler: str = "") -> _b.BuildSpec:
    """The build spec of library ``name`` (``compiler`` only matters for the JIT cache's key)."""
    sources, lang, torch, *rest = LIBRARIES[name]
    flags = tuple(rest[0]) if rest else ()
    return _b.BuildSpec(name, tuple(sources), lang, torch, flags, compiler, GENERATED.get(name, ()))


def _prebuilt(name: str) -> tuple[Path | None, str]:
    """The wheel's library ``name`` when it matches this install, else None and why not."""
    manifest = prebuilt.read_manifest()
    sp = spec(name)
    reason = prebuilt.check(manifest, name, source_key=_b.source_key(sp), abi=_b.abi_tag(),
                            torch=_b.torch_tag() if sp.torch else None)
    if reason is None:
        assert manifest is not None  # check() returns a reason without one
        path = prebuilt.DIRECTORY / manifest["libraries"][name]["path"]
        if path.is_file():
            return path, ""
        reason = f"prebuilt {name} is listed but missing ({path})"
    return None, reason


def _build(name: str, *, use_prebuilt: bool = True) -> Path:
    """The library's path: the wheel's prebuilt one when it matches, else the JIT cache's (building it)."""
    path, reason = _prebuilt(name) if use_prebuilt else (None, "the prebuilt library did not load")
    if path is not None:
        _origin[name] = "prebuilt"
        return path
    if prebuilt.read_manifest() is not None:  # a wheel whose library does not fit: say so once
        logging.getLogger("zbccl").warning("zbccl: %s; using the JIT build cache instead", reason)
    sp = spec(name)
    try:
        out = _b.build(name, list(sp.sources), lang=sp.lang, torch=sp.torch, extra_flags=sp.flags,
                       generated=sp.generated)
    except ZbcclSystemError as exc:
        raise ZbcclSystemError(f"native: {name} is not available ({reason}), and building it failed: {exc}; "
                               f"{_INSTALL_HINT}") from None
    _origin[name] = "cache"
    return out


def _load_core(path: Path, modname: str = "zbccl._native_core") -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(modname, str(path))
    mspec = importlib.util.spec_from_file_location(modname, str(path), loader=loader)
    if mspec is None:
        raise ZbcclSystemError(f"native: cannot load {path}, expected an extension module")
    module = importlib.util.module_from_spec(mspec)
    loader.exec_module(module)
    sys.modules[modname] = module
    return module


def _load(name: str, load: Callable[[Path], Any]) -> Any:
    """``load`` the library's path; a prebuilt library that does not load (a missing system library)
    falls back to the JIT cache once, with a warning naming why."""
    path = _build(name)
    try:
        return load(path)
    except (ImportError, OSError) as exc:
        if _origin.get(name) != "prebuilt":
            raise
        logging.getLogger("zbccl").warning("zbccl: the prebuilt %s does not load (%s); using the JIT build cache "
                                           "instead", name, exc)
        return load(_build(name, use_prebuilt=False))


def core() -> ModuleType:
    """The native core module (built on first use, then cached for the process).

    Functions: ``load_acquire(addr)``, ``store_release(addr, v)``,
    ``fetch_add(addr, d)``, ``signal(addr, v)``, ``fetch_add_signal(addr, d)``,
    ``wait_ge(addrs_ptr, n, target, spin, budget_ns)``,
    ``wait_eq(addr, v, spin, budget_ns)``, ``now_ns()``,
    ``memcpy(dst, src, n)``, ``memset(dst, byte, n)``. See ``csrc/py/module.c``.
    """
    mod = _loaded.get("core")
    if mod is None:
        with _lock:
            mod = _loaded.get("core")
            if mod is None:
                mod = _load("core", _load_core)
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

                try:
                    lib = _loaded["cpu_alloc_hook"] = _load("cpu_alloc_hook", lambda p: ctypes.CDLL(str(p)))
                except (ZbcclSystemError, OSError) as exc:
                    _failed["cpu_alloc_hook"] = str(exc)
                    raise ZbcclSystemError(f"heap_scope: the allocator hook is not available: {exc}") from None
    return lib


def hot() -> ModuleType | None:
    """The native hot-entry module (built on first use), or None where it cannot be built or loaded
    (no C++ compiler, torch without its headers): the Python path then serves every call."""
    if "hot" not in _loaded:
        with _lock:
            if "hot" not in _loaded:
                try:
                    import torch  # noqa: F401  (libtorch_python must be loaded first)

                    _loaded["hot"] = _load("hot", lambda p: _load_core(p, "zbccl._native_hot"))
                except Exception as exc:  # noqa: BLE001 - optional: the Python path does the same
                    logging.getLogger("zbccl").info("zbccl: native hot entry unavailable (%s)", exc)
                    _loaded["hot"] = None
                    _failed["hot"] = str(exc)
    return _loaded["hot"]


def build_all() -> dict[str, Path]:
    """Build every library now (``zbccl build``, ``make``) unless the wheel's fits; returns name -> path."""
    return {name: _build(name) for name in LIBRARIES}


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_torch() -> None:
    """Refuse a torch below :data:`MIN_TORCH`; warn once on one no test ran on (:data:`TESTED_TORCH`)."""
    global _torch_checked
    if _torch_checked:
        return
    import torch

    version = _torch_version()
    if version < MIN_TORCH:
        raise ZbcclSystemError(
            f"init: torch too old, expected torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (tested: "
            f"{', '.join(TESTED_TORCH)}), got {torch.__version__}")
    _torch_checked = True
    if f"{version[0]}.{version[1]}" not in TESTED_TORCH:
        warnings.warn(
            f"zbccl: torch {torch.__version__} is untested (the test suite ran on torch {', '.join(TESTED_TORCH)}); "
            "zbccl should work but has not been checked on it (see the README's support matrix)",
            RuntimeWarning, stacklevel=3)


def _cached(name: str) -> bool:
    """Whether ``name`` is ready without compiling (prebuilt and matching, or in the JIT cache)."""
    if name in _loaded or _prebuilt(name)[0] is not None:
        return True
    try:
        return (_b.cache_path(spec(name, _b.find_compiler(spec(name).lang))) / _b.lib_filename(name)).exists()
    except ZbcclSystemError:
        return False


def _has_compiler() -> bool:
    try:
        _b.find_compiler("c")
    except ZbcclSystemError:
        return False
    return True


def prepare(*, world_size: int) -> None:
    """Make every native library ready now, before any op (``zbccl.init`` calls it).

    Not collective; blocks while a JIT build runs (first use of a source install: one log line, then
    about 20 s; several ranks share one build through the cache's lock). The core is required when
    ``world_size`` > 1 (the null backend serves world size 1 without it), and so is the allocator
    hook, which ``heap_scope`` needs; the hot entry is optional (the Python path does the same work).
    Raises :class:`ZbcclSystemError` naming what is missing and what to install.
    """
    check_torch()
    missing = [n for n in LIBRARIES if n not in _failed and not _cached(n)]
    if missing and _has_compiler():
        print(f"zbccl: building zbccl native libraries (first use, ~20 s): {', '.join(missing)}, cached in "
              f"{env.CACHE_DIR.get() / 'native'} ...", file=sys.stderr, flush=True)
    try:
        core()
    except Exception as exc:
        if world_size > 1:
            raise ZbcclSystemError(f"init: the native core is required for world size {world_size}: {exc}") from None
        logging.getLogger("zbccl").info("zbccl: native core unavailable (%s); world size 1 runs without it", exc)
        return
    hot()
    try:
        alloc_hook()
    except ZbcclSystemError:
        if world_size > 1:
            raise


def status() -> dict[str, dict[str, Any]]:
    """For ``zbccl info``: per library, whether it is built, where, how long it took, with what.

    Never compiles; runs the compiler's ``--version`` once to find the key.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, (sources, lang, torch, *rest) in LIBRARIES.items():
        row: dict[str, Any] = {"built": False, "loaded": name in _loaded}
        if name in _failed:
            row["error"] = _failed[name]
        flags = tuple(rest[0]) if rest else ()
        path, reason = _prebuilt(name)
        if path is not None:
            row.update(built=True, path=str(path), origin="prebuilt (wheel)")
            out[name] = row
            continue
        row["prebuilt"] = reason
        try:
            sp = _b.BuildSpec(name, sources, lang, torch, flags, _b.find_compiler(lang),  # type: ignore[arg-type]
                              GENERATED.get(name, ()))
            directory = _b.cache_path(sp)
        except Exception as exc:  # a missing compiler or torch is a status, not a crash
            row["error"] = str(exc)
            out[name] = row
            continue
        lib = directory / _b.lib_filename(name)
        info = _b.read_build_info(directory) if lib.exists() else {}
        row.update(
            built=lib.exists(),
            path=str(lib),
            origin="JIT cache",
            build_seconds=info.get("seconds"),
            compiler=info.get("compiler", sp.compiler),
        )
        out[name] = row
    return out
