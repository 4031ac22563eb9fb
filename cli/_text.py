"""Help-text helpers shared by the subcommands (plain text: the app renders no markup)."""

from __future__ import annotations

__all__ = ["examples"]


def examples(*lines: str) -> str:
    """An epilog of example command lines printed as written; ``""`` separates groups of lines.

    click rewraps every paragraph unless it starts with a ``\\b`` line.
    """
    groups = "\n".join(lines).split("\n\n")
    return "Examples:\n\n" + "\n\n".join(f"\b\n{g}" for g in groups)
