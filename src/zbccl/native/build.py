"""Build-and-cache of zbccl's native code, without ninja or setuptools.

:func:`build` compiles a set of sources into one shared object under
``<ZBCCL_CACHE_DIR>/native/<name>-<key>/`` where ``key`` hashes everything
that changes the output: the source bytes, the flags, the compiler's
``--version`` text, the Python ABI tag and, for torch code, torch's version.
A later call (or a later process) finds the directory and only stats it.

Several ranks usually start at once, so a build holds an ``fcntl.flock`` on
``<name>-<key>.lock``, compiles into a temporary directory beside the target
and publishes it with one ``os.replace``: a directory that exists is complete.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import env
from ..errors import ZbcclSystemError

__all__ = ["BuildSpec", "abi_tag", "build", "cache_path", "compile_into", "find_compiler", "lib_filename",
           "read_build_info", "source_key", "torch_tag"]

Lang = Literal["c", "c++"]

_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-Wall", "-fno-strict-aliasing")
_LANG_FLAGS = {"c": ("-std=gnu11",), "c++": ("-std=c++17",)}
_STDERR_TAIL = 4000


@dataclass(frozen=True)
class BuildSpec:
    """Everything that determines one library's bytes (and so its cache key)."""

    name: str
    sources: tuple[Path, ...]
    lang: Lang
    torch: bool
    flags: tuple[str, ...]
    compiler: str
    #: ``(file name, text)`` of headers generated before compiling (``zb_abi.h`` from native/abi.py):
    #: hashed into the key like sources, written into the build directory, found by ``-I``.
    generated: tuple[tuple[str, str], ...] = ()


def find_compiler(lang: Lang) -> str:
    """The compiler driver: ``ZBCCL_CXX``, else ``$CXX``/``$CC``, else g++/gcc, else c++/cc.

    Sources are passed with ``-x <lang>``, so one driver serves both languages.
    """
    chosen = env.CXX.get()
    if chosen:
        return chosen
    order = ("CXX", "g++", "c++") if lang == "c++" else ("CC", "gcc", "cc")
    from_env = os.environ.get(order[0], "")
    if from_env:
        return from_env
    for candidate in order[1:]:
        found = shutil.which(candidate)
        if found:
            return found
    raise ZbcclSystemError(
        f"native build: no {lang} compiler, expected {order[1]} or {order[2]} on PATH (or ZBCCL_CXX), got none"
    )


#: Tries and first back-off of a compiler run that fails with EAGAIN (fork or exec refused by a full
#: process or thread table: a loaded host with many ranks starting at once).
_SPAWN_TRIES, _SPAWN_BACKOFF_S = 6, 0.05


def _run(cmd: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that retries, with doubling back-off, when the fork itself fails with EAGAIN."""
    delay = _SPAWN_BACKOFF_S
    for attempt in range(_SPAWN_TRIES):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except BlockingIOError:  # EAGAIN from fork/clone: no process slot free right now
            if attempt == _SPAWN_TRIES - 1:
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _compiler_identity(compiler: str) -> str | None:
    """The resolved driver's path, inode, size and mtime: a new compiler (an upgrade) gets a new identity."""
    path = shutil.which(compiler) or compiler
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _versions_file() -> Path:
    return env.CACHE_DIR.get() / "native" / "compilers.json"


@functools.lru_cache(maxsize=8)
def _compiler_version(compiler: str) -> str:
    """The compiler's ``--version`` text (part of every JIT cache key).

    :func:`build` records it in ``<cache>/native/compilers.json`` by the driver's identity, so a process
    whose libraries are already built (every rank of every later job) spawns no compiler just to find
    them: no fork per rank and init, where several ranks start at once on a loaded host (a full
    process table made that fork fail with EAGAIN inside a test's first ``heap_scope``).
    """
    ident = _compiler_identity(compiler)
    if ident is not None:
        known = _known_versions()
        if isinstance(known.get(ident), str):
            return known[ident]
    try:
        out = _run([compiler, "--version"], timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ZbcclSystemError(f"native build: cannot run compiler {compiler!r}: {exc}") from None
    return out.stdout + out.stderr


def _known_versions() -> dict[str, str]:
    try:
        known = json.loads(_versions_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember_version(compiler: str) -> None:
    """Record ``compiler``'s ``--version`` in the cache (atomic replace; a lost race costs one rerun later)."""
    ident = _compiler_identity(compiler)
    if ident is None:
        return
    known = _known_versions()
    if ident in known:
        return
    target = _versions_file()
    try:
        fd, tmp = tempfile.mkstemp(prefix=".compilers.", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({**known, ident: _compiler_version(compiler)}, f)
        os.replace(tmp, target)
    except OSError:
        pass  # read-only cache: the version is asked again next time


def abi_tag() -> str:
    """The Python ABI a CPython extension is built for (``cpython-311-cpython-311-x86_64-linux-gnu``)."""
    return f"{sys.implementation.cache_tag}-{sysconfig.get_config_var('SOABI') or ''}"


def torch_tag() -> str:
    """What a library linked against torch's C++ API depends on: the release (without the local label:
    ``2.13.0+cpu`` and ``2.13.0+cu130`` share the C++ API of ``c10``) and the libstdc++ string ABI."""
    import torch

    return f"{torch.__version__.split('+')[0]}-cxx11abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


@functools.lru_cache(maxsize=1)
def _torch_flags() -> tuple[str, ...]:
    import torch
    from torch.utils import cpp_extension

    lib_dir = str(Path(torch.__file__).parent / "lib")
    incs = tuple(f"-I{p}" for p in cpp_extension.include_paths())
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return (*incs, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10")


def _python_flags() -> tuple[str, ...]:
    return (f"-I{sysconfig.get_paths()['include']}",)


def lib_filename(name: str) -> str:
    """The shared object's file name inside its cache directory."""
    return f"{name}.so"


def source_key(spec: BuildSpec) -> str:
    """The hash of what the library is built from: sources, generated headers, language and flags.

    Independent of the compiler and the machine, so a wheel's manifest can record it at build time and
    the loader compare it with the installed sources (:mod:`zbccl.native.prebuilt`).
    """
    h = hashlib.sha256()
    for src in spec.sources:  # the layer folder with the name (csrc/core/chan.c): a file moved between layers
        h.update(f"{src.parent.name}/{src.name}".encode() + b"\0" + src.read_bytes() + b"\0")
    for name, text in spec.generated:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update("\0".join((spec.lang, *spec.flags)).encode())
    return h.hexdigest()[:20]


def _key(spec: BuildSpec) -> str:
    h = hashlib.sha256(source_key(spec).encode())
    h.update(_compiler_version(spec.compiler).encode())
    h.update(abi_tag().encode())
    if spec.torch:
        import torch

        h.update(torch.__version__.encode())
    return h.hexdigest()[:20]


def cache_path(spec: BuildSpec) -> Path:
    """The directory this spec builds into (it exists once the build is complete)."""
    return env.CACHE_DIR.get() / "native" / f"{spec.name}-{_key(spec)}"


def _command(spec: BuildSpec, out: Path) -> list[str]:
    lang_flags = _LANG_FLAGS[spec.lang]
    sys_flags = _torch_flags() if spec.torch else _python_flags()
    gen = (f"-I{out.parent}",) if spec.generated else ()
    cmd = [spec.compiler, *_BASE_FLAGS, *lang_flags, *spec.flags, *gen, "-x", spec.lang]
    # Headers are in ``sources`` for the cache key only; the compiler finds them by #include.
    cmd += [str(s) for s in spec.sources if s.suffix not in (".h", ".hpp")]
    cmd += ["-x", "none", *sys_flags, "-o", str(out)]
    if spec.lang == "c++":
        cmd.append("-lstdc++")
    return cmd


def compile_into(spec: BuildSpec, directory: Path) -> Path:
    """Compile ``spec`` into ``directory`` (which must exist) and return the library's path.

    Writes the generated headers and ``build.json`` (seconds, compiler, command) beside it. Used by
    the cache below and by ``setup.py``, which puts the result into the wheel: one recipe for both.
    """
    for name, text in spec.generated:
        (directory / name).write_text(text)
    out = directory / lib_filename(spec.name)
    cmd = _command(spec, out)
    t0 = time.perf_counter()
    try:
        proc = _run(cmd, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ZbcclSystemError(f"native build: cannot run {' '.join(cmd)}: {exc}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-_STDERR_TAIL:]
        raise ZbcclSystemError(
            f"native build: compiling {spec.name} failed, expected exit 0, got {proc.returncode}\n"
            f"command: {' '.join(cmd)}\n{tail}"
        )
    info = {
        "name": spec.name,
        "seconds": round(time.perf_counter() - t0, 3),
        "compiler": spec.compiler,
        "compiler_version": _compiler_version(spec.compiler).splitlines()[0:1],
        "command": cmd,
        "built_at": time.time(),
    }
    (directory / "build.json").write_text(json.dumps(info, indent=1))
    return out


def _compile(spec: BuildSpec, final: Path) -> None:
    """Compile into a temp dir beside ``final`` and publish it with os.replace."""
    print(f"zbccl: building native library {spec.name} (first use, cached in {final})...", file=sys.stderr,
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        compile_into(spec, tmp)
        if final.exists():  # left incomplete by hand; a published build always has its library
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_build_info(directory: Path) -> dict:
    """The ``build.json`` written beside a built library ({} when unreadable)."""
    try:
        return json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def build(
    name: str,
    sources: Sequence[Path],
    *,
    lang: Lang,
    torch: bool = False,
    extra_flags: Sequence[str] = (),
    generated: Sequence[tuple[str, str]] = (),
) -> Path:
    """Compile ``sources`` into a cached shared object and return its path.

    Blocks the host while compiling (first use only; prints one line to
    stderr). Safe to call from several processes at once: one compiles, the
    others wait on the lock and find the result. ``torch=True`` compiles
    against torch's headers and links ``libc10`` (plain C++ library, loaded
    with ctypes); otherwise the result is a CPython extension module.
    Raises :class:`ZbcclSystemError` with the command and the compiler's
    stderr tail when compilation fails. ``generated``: ``(file name, text)`` headers written
    beside the objects before compiling (part of the cache key).
    """
    if lang not in _LANG_FLAGS:
        raise ValueError(f"native build: bad lang, expected 'c' or 'c++', got {lang!r}")
    spec = BuildSpec(name, tuple(Path(s) for s in sources), lang, torch, tuple(extra_flags), find_compiler(lang),
                     tuple(generated))
    final = cache_path(spec)
    lib = final / lib_filename(name)
    if lib.exists():
        _remember_version(spec.compiler)
        return lib
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / f"{final.name}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not lib.exists():
                    _compile(spec, final)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as exc:  # the compiler's own failures are ZbcclSystemError already
        raise ZbcclSystemError(
            f"native build: cannot write the build cache, expected a writable directory in ZBCCL_CACHE_DIR "
            f"({final.parent}), got {type(exc).__name__}: {exc.strerror or exc}") from None
    _remember_version(spec.compiler)
    return lib
