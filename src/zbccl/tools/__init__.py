"""Command-line tools built on the public API: info, demo, local launcher."""

__all__: list[str] = []
