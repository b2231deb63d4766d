"""SGLang plugin: ``--enable-zbccl`` runs SGLang's TP/PP group collectives on zbccl.

Entry point ``sglang.srt.plugins`` -> :func:`register` (pyproject.toml). SGLang's
``load_plugins()`` runs it in every process (the launcher, the Engine, every TP/PP scheduler
process before it builds its groups) and then applies the hooks registered with SGLang's
``HookRegistry``; SGLang's source is not patched.

* **Switch.** ``python -m sglang.launch_server ... --enable-zbccl`` (a flag this plugin adds to
  SGLang's CLI: an AFTER hook on ``ServerArgs.add_cli_args``; an AROUND hook on
  ``ServerArgs.from_cli_args`` turns it into ``ZBCCL_ENABLE=1`` for the scheduler processes
  SGLang spawns). ``sgl.Engine(...)`` rejects unknown keyword arguments, so there
  ``ZBCCL_ENABLE=1`` in the environment is the switch. Without either, only the flag is added and
  SGLang runs exactly as shipped.
* **Routing** (with the switch, in each process): an AFTER hook on ``GroupCoordinator.__init__``
  puts each routed group on zbccl (:func:`.group.attach`: start, agreement, fallback with one
  warning), one AROUND hook per method of :data:`.group.ROUTES` runs it there, and an AROUND hook
  on ``ModelRunner.forward`` runs the forward in ``zbccl.heap_scope`` (:mod:`.forward`), so that
  the activations SGLang all-reduces are heap tensors and nothing is staged. An AFTER hook on
  ``Scheduler.get_internal_state`` adds each TP worker's zbccl statistics to ``/server_info``
  (``internal_states[0]["zbccl"]``; :mod:`.probe`).
* **Version.** The hook targets are SGLang internals: the plugin is written against and tested
  with :data:`SGLANG_VERSION` only. Under another version it registers nothing but the flag, and
  a request for zbccl (the flag or ``ZBCCL_ENABLE=1``) is refused with one warning; SGLang then
  runs its own communication.
* **MoE.** TP MoE layers all-reduce through the routed TP group. For expert parallelism,
  :mod:`.ep` offers ``zbccl.ep.Buffer`` as an SGLang ``BaseDispatcher``.

Nothing is started at import or registration: zbccl starts in the scheduler processes, when
SGLang builds its groups.
"""

from __future__ import annotations

import logging
import os
import warnings

from ... import env

__all__ = ["SGLANG_VERSION", "FLAG", "register", "supported", "installed_version", "enabled", "cli_hooks",
           "worker_hooks"]

#: The SGLang release this plugin was written against and is tested with.
SGLANG_VERSION = "0.5.23"
#: The command-line flag the plugin adds to SGLang's server arguments.
FLAG = "--enable-zbccl"

_state = {"registered": False, "warned": False}
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_GC = "sglang.srt.distributed.parallel_state.GroupCoordinator"
_SA = "sglang.srt.server_args.ServerArgs"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_MOE_DISPATCHER = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"


def supported(version: str) -> bool:
    """Whether ``version`` is the pinned release (local tags such as ``+cpu`` ignored)."""
    return version.split("+")[0] == SGLANG_VERSION


def installed_version() -> str:
    """The installed SGLang's version (its distribution metadata), or ``"none"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "none"


def enabled() -> bool:
    """Whether zbccl was asked for in this process (``ZBCCL_ENABLE``; ``--enable-zbccl`` sets it)."""
    return env.SGLANG.get()


def _refuse(version: str, how: str) -> None:
    """One warning per process: zbccl was asked for under an SGLang this plugin does not support."""
    if _state["warned"]:
        return
    _state["warned"] = True
    warnings.warn(f"zbccl: {how} is refused: the SGLang plugin hooks SGLang internals and supports sglang "
                  f"{SGLANG_VERSION} only, expected {SGLANG_VERSION}, got {version}; SGLang runs its own "
                  f"communication", RuntimeWarning, stacklevel=3)


def _add_cli_args(result, parser, *args, **kwargs):
    """AFTER ``ServerArgs.add_cli_args(parser)``: the ``--enable-zbccl`` flag (unless SGLang has one)."""
    if FLAG not in getattr(parser, "_option_string_actions", {}):
        parser.add_argument(FLAG, action="store_true", default=False,
                            help="Run the TP/PP collectives of every worker on zbccl's zero-buffer shared heap "
                                 "(zbccl SGLang plugin; falls back to SGLang's own path with a warning when "
                                 "zbccl cannot start).")
    return result


def _from_cli_args(original, cls, args, *rest, **kwargs):
    """AROUND ``ServerArgs.from_cli_args(args)``: ``--enable-zbccl`` -> ``ZBCCL_ENABLE=1`` for the workers.

    The flag is not a ``ServerArgs`` field (``from_cli_args`` takes only fields), so it travels to
    the scheduler processes SGLang spawns in their inherited environment.
    """
    if getattr(args, "enable_zbccl", False):
        version = installed_version()
        if supported(version):
            os.environ[env.SGLANG.name] = "1"
            logging.getLogger("sglang.srt.plugins.zbccl").info("zbccl: %s: SGLang's TP/PP collectives run on zbccl",
                                                                 FLAG)
        else:
            _refuse(version, FLAG)
    return original(cls, args, *rest, **kwargs)


def cli_hooks() -> list[tuple[str, object, str]]:
    """(target, hook, HookType name) of the flag: registered in every process."""
    return [(f"{_SA}.add_cli_args", _add_cli_args, "AFTER"),
            (f"{_SA}.from_cli_args", _from_cli_args, "AROUND")]


def worker_hooks() -> list[tuple[str, object, str]]:
    """(target, hook, HookType name) of the routing: registered when zbccl is enabled."""
    from . import forward, group, probe

    hooks = [(f"{_GC}.__init__", group.attach, "AFTER")]
    hooks += [(f"{_GC}.{name}", group.around(name), "AROUND") for name in group.ROUTES]
    hooks += [(f"{_MR}.forward", forward.scoped_forward, "AROUND"),
              (f"{_SCHED}.get_internal_state", probe.add_internal_state, "AFTER"),
              (_MOE_DISPATCHER, _create_moe_dispatcher, "AROUND")]
    return hooks


def _create_moe_dispatcher(original, *args, **kwargs):
    """AROUND ``create_moe_dispatcher``: zbccl's EP dispatcher where it applies (:mod:`.ep`, imported here:
    it subclasses SGLang's ``BaseDispatcher``)."""
    from .ep import create_moe_dispatcher

    return create_moe_dispatcher(original, *args, **kwargs)


def register() -> None:
    """SGLang's general-plugin hook (``sglang.srt.plugins``). Idempotent; registers hooks only.

    Always: the ``--enable-zbccl`` flag. With ``ZBCCL_ENABLE=1`` under the pinned SGLang: the routing
    hooks. With ``ZBCCL_SGLANG_PROBE=1`` (benchmarks, tests): per-op timing of the routed groups on
    either path (:mod:`.probe`).
    """
    if _state["registered"]:
        return
    _state["registered"] = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = cli_hooks()
    version = installed_version()
    if supported(version):
        if enabled():
            hooks += worker_hooks()
        if env.SGLANG_PROBE.get():
            from . import probe

            hooks += probe.probe_hooks(already=[t for t, _, _ in hooks])
    elif enabled():
        _refuse(version, f"{env.SGLANG.name}=1")
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, HookType[kind])
