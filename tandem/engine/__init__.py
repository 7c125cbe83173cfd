"""The engine loop and what surrounds it: request intake, outputs, n > 1, stats."""

from tandem.engine.engine import Engine

__all__ = ["Engine"]
