"""Text helpers shared by the subcommands.

Help texts are plain text (the app renders no markup). What a command prints through rich (a
``Console``, a ``Table``) *is* read as markup, so every message, exception text, path or config value
put into such a string goes through :func:`escape` (or :func:`print_error`) once, where it is printed:
rich takes ``[ray]`` or ``[schedule]`` for a style tag and drops it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["escape", "examples", "print_error"]


def examples(*lines: str) -> str:
    """An epilog of example command lines printed as written; ``""`` separates groups of lines.

    click rewraps every paragraph unless it starts with a ``\\b`` line.
    """
    groups = "\n".join(lines).split("\n\n")
    return "Examples:\n\n" + "\n\n".join(f"\b\n{g}" for g in groups)


def escape(text: object) -> str:
    """``str(text)`` for a rich markup string or table cell, so that it prints as written.

    Escape each piece of text once, where it joins the markup: escaping twice prints the backslashes.
    """
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def print_error(console: Console, exc: BaseException | str, label: str | None = None) -> None:
    """Print ``label: message`` with the label in red and the message (an exception's, or a text) as written.

    ``label`` defaults to the exception's class name (``ConfigError: ...``).
    """
    if label is None:
        label = type(exc).__name__
    console.print(f"[red]{escape(label)}:[/red] {escape(exc)}")
