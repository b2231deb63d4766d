"""Engine integrations (vLLM, later SGLang): plugins that put an engine's communication on zbccl.

Each engine has its own subpackage, pinned to the engine version it was tested with. They are
imported lazily, only by the engine's entry points, never from ``zbccl/__init__.py``, and they
depend on the adapters, never the reverse.
"""

__all__: list[str] = []
