"""How users install asyncllm: the distribution's name on the package index and the pip commands that error
messages print for a missing extra. The import name and the command stay `asyncllm`; the name `asyncllm` on
PyPI belongs to an unrelated project, so the distribution is `asyncllm-engine`. Imports nothing.
"""

from __future__ import annotations

DISTRIBUTION = "asyncllm-engine"  # pyproject.toml's [project] name; importlib.metadata looks it up by this


def extra_install_hint(extra: str) -> str:
    """The commands that add an optional extra (docs/install.md): from a clone today, from the index once
    the distribution is published there."""
    return f'from a clone: pip install -e ".[{extra}]"; once published: pip install "{DISTRIBUTION}[{extra}]"'
