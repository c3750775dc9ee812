"""How long steps say what they are doing: a callable taking one line (the CLI prints it to
stderr; the library's default is silence)."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]
