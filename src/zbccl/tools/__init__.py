"""Command-line tools built on the public API: info, demo, local launcher, namespace hosts (netns)."""

__all__: list[str] = []
