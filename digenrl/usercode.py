"""Code the user writes in Python and names in a config: ``"path/to/file.py:ClassName"``.

A user's reward (``[reward.models.<name>] python = ...``) and a user's algorithm (``train.algorithm = ...``) are
both spelled this way: a file path, a colon, a class name. A file rather than an importable module, because such
code is usually one file beside the config: nothing to install, no ``PYTHONPATH``, and the path says exactly
which code runs. A relative path starts at the working directory of the process that reads it (where ``digenrl
run`` was started; the actor processes it launches inherit it); ``~`` is expanded.

**Who imports it.** Importing a file runs its code, so a process imports only a file its own start allowed
(:func:`allow`), never one because a message named it (the actor allow-list's rule, ``digenrl/actors/allowlist.py``):

* a process that read a config itself (``digenrl.config.load_config``: ``digenrl run``, ``plan``, ``validate``,
  a test) allows that config's files;
* an actor process a driver launches on its host inherits them in :data:`USER_CODE_ENV`, which the driver sets in
  that process's environment (:func:`launch_env`);
* ``digenrl worker --join`` allows those named with ``--allow-reward`` / ``--allow-algorithm``.

A config handed to an actor in its spawn message is checked against that list by resolved path and class name
(:func:`load_class`), and a file not on it is refused before it is read. This module imports only ``errors``, so
every layer may use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from digenrl.errors import ConfigError

__all__ = ["USER_CODE_ENV", "split_spec", "resolve_spec", "allow", "allowed", "launch_env", "load_class", "failure"]

USER_CODE_ENV = "DIGENRL_USER_CODE"
"""A JSON list of ``"/abs/file.py:ClassName"`` a driver gives the actor processes it launches (not user config)."""

_ALLOWED: set[str] = set()
_LOCK = threading.Lock()  # user classes are built on actors' threads; one import of a file per process


def split_spec(spec: Any, key: str, what: str = "class") -> tuple[str, str]:
    """``"path/to/file.py:ClassName"`` split into the path as written and the class name; reads no file.

    Raises:
        ConfigError: naming ``key``, with the expected spelling (``what``: the class it should name).
    """
    path, sep, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not path.endswith(".py") or not attr.isidentifier():
        raise ConfigError(f"{key}: must be 'path/to/file.py:ClassName' (a Python file and the {what} in it), "
                          f"got {spec!r}")
    return path, attr


def resolve_spec(spec: str, key: str, what: str = "class") -> str:
    """The spec with its path made absolute: what grants compare."""
    path, attr = split_spec(spec, key, what)
    return f"{Path(path).expanduser().resolve()}:{attr}"


def allow(spec: str, key: str, what: str = "class") -> str:
    """Let this process import ``"path/to/file.py:ClassName"``; returns it resolved.

    Raises:
        ConfigError: ``spec`` not spelled ``path.py:ClassName`` (naming ``key``).
    """
    resolved = resolve_spec(spec, key, what)
    _ALLOWED.add(resolved)
    return resolved


def allowed() -> frozenset[str]:
    """The resolved ``file:ClassName`` this process may import: allowed here, or by its launcher's environment."""
    try:
        inherited = json.loads(os.environ.get(USER_CODE_ENV, "[]"))
    except ValueError:  # not ours to repair: it grants nothing
        inherited = []
    inherited = [s for s in inherited if isinstance(s, str)] if isinstance(inherited, list) else []
    return frozenset(_ALLOWED | set(inherited))


def launch_env(specs: list[str], key: str) -> dict[str, str]:
    """The environment an actor process this driver launches needs to import ``specs`` (its own config's).

    Raises:
        ConfigError: a spec this process was not allowed itself (it grants nothing it does not hold).
    """
    resolved = sorted({resolve_spec(s, key) for s in specs})
    for spec in resolved:
        if spec not in allowed():
            raise ConfigError(f"{key}: {spec} is not this process's own config's; it grants it to no other")
    return {USER_CODE_ENV: json.dumps(resolved)} if resolved else {}


def _where(exc: BaseException, path: Path) -> str:
    """``"file.py line 7: y = 1 / 0"``: the innermost line of ``path`` the exception passed through (else its last)."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f"{Path(exc.filename or path).name} line {exc.lineno}: {(exc.text or '').strip()}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if Path(f.filename) == path] or frames
    if not mine:
        return path.name
    f = mine[-1]
    return f"{Path(f.filename).name} line {f.lineno}: {(f.line or '').strip()}"


def failure(exc: BaseException, path: Path) -> str:
    """One line for an exception the user's code raised: ``"ZeroDivisionError: division by zero (f.py line 7: ...)"``."""
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {message} ({_where(exc, path)})"


def _import(path: Path, key: str) -> ModuleType:
    """The file as a module, imported once per process (in ``sys.modules`` under a name of its own).

    Raises:
        ConfigError: importing it raised (the exception and the file's line).
    """
    mod_name = f"digenrl_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    with _LOCK:
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{key}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # before exec: dataclasses and pickling look their module up
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[mod_name]
            if not isinstance(exc, Exception):
                raise
            raise ConfigError(f"{key}: importing {path} raised {failure(exc, path)}") from None
        return module


def load_class(spec: Any, key: str, what: str, allow_flag: str) -> tuple[type, Path]:
    """The class ``spec`` names, imported once this process is allowed its file; and the file.

    Args:
        key: the config key errors name (``train.algorithm``, ``reward.models.<name>.python``).
        what: what the class should be, for the errors (``"reward class"``).
        allow_flag: the ``digenrl worker`` option that allows it, for the refusal's hint.

    Raises:
        ConfigError: naming ``key``: spelling, not allowed in this process, missing file, import failure, no such
            attribute, not a class.
    """
    written, attr = split_spec(spec, key, what)
    path = Path(written).expanduser().resolve()
    if f"{path}:{attr}" not in allowed():
        raise ConfigError(f"{key}: this process was not started with {written}:{attr}, so it does not import it (a "
                          f"file named in a message is never imported); a joined worker names it with "
                          f"`digenrl worker {allow_flag} {written}:{attr}`")
    if not path.is_file():
        raise ConfigError(f"{key}: no file {written} (looked for {path}; relative paths start at the working "
                          f"directory, {Path.cwd()})")
    module = _import(path, key)
    if not hasattr(module, attr):
        classes = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
        raise ConfigError(f"{key}: {written} has no attribute {attr!r} (its classes: {', '.join(classes) or 'none'})")
    cls = getattr(module, attr)
    if not inspect.isclass(cls):
        kind = "a function" if inspect.isfunction(cls) else f"a {type(cls).__name__}"
        raise ConfigError(f"{key}: {written}:{attr} is {kind}, not a class; name a {what}")
    return cls, path
