"""``log.wandb = true``: a run's metrics, sample grids and config in a Weights & Biases run under ``DIR/wandb``.

W&B is an optional extra (``pip install 'digenrl[wandb]'``), imported only here and only when the key is on;
without it the run refuses at once with one line naming the key and the install command (``digenrl validate``
says so too). Only the driver process logs (the actors never import it).

Where it goes (``log.wandb_mode``): ``"offline"`` writes ``DIR/wandb/offline-run-<time>-<id>/`` (sync it later
with ``wandb sync``); ``"online"`` streams to the server; ``"auto"`` (default) takes ``WANDB_MODE`` when it is
set, else goes online only when this host is logged in (``WANDB_API_KEY`` or a ``wandb login`` entry in
``~/.netrc``) and the server (``WANDB_BASE_URL``, default ``https://api.wandb.ai``) accepts a connection within
2 s, and offline otherwise, saying why. W&B's console capture is off (``console="off"``) and its own messages
silent: the run's stdout (the live table or its plain lines) stays the run's. Weave's automatic tracing of LLM
calls (the ``vlm_judge`` reward's) stays off unless ``WANDB_DISABLE_WEAVE`` says otherwise. A resumed run continues the same
W&B run: its id is kept in ``DIR/wandb/digenrl-run-id``.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from digenrl.errors import ConfigError

__all__ = ["WandbLog", "WANDB_MISSING", "check_wandb", "resolve_mode"]

log = logging.getLogger(__name__)

WANDB_MISSING = ("log.wandb = true needs the wandb package, which is not installed: pip install 'digenrl[wandb]' "
                 "(or pip install 'wandb>=0.30'), or set log.wandb = false")
RUN_ID_FILE = "digenrl-run-id"


def check_wandb() -> None:
    """Refuse ``log.wandb = true`` at once where W&B is not installed (found, not imported).

    Raises:
        ConfigError: :data:`WANDB_MISSING`.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a module entry without a spec (a stub, or one set to None)
        found = False
    if not found:
        raise ConfigError(WANDB_MISSING)


def _server() -> tuple[str, int]:
    url = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def _logged_in(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(setting: str) -> tuple[str, str]:
    """``(mode, why)`` for ``log.wandb_mode`` (see the module docstring); nothing is contacted unless it is
    ``"auto"``, ``WANDB_MODE`` is unset and this host is logged in."""
    if setting != "auto":
        return setting, f"log.wandb_mode = {setting!r}"
    env = os.environ.get("WANDB_MODE", "").strip()
    if env:
        return env, f"WANDB_MODE={env}"
    host, port = _server()
    if not _logged_in(host):
        return "offline", f"this host is not logged in to {host} (WANDB_API_KEY or `wandb login`)"
    if not _reachable(host, port):
        return "offline", f"{host}:{port} is not reachable"
    return "online", f"logged in to {host}"


class WandbLog:
    """One W&B run of a digenrl run (the driver's); every call is a no-op after :meth:`close`.

    Args:
        out: the run directory (W&B writes ``out/wandb``).
        config: the run's config (``Config.to_dict()``), recorded with the run.
        project, entity, mode: ``log.wandb_project``, ``log.wandb_entity``, ``log.wandb_mode``.

    Raises:
        ConfigError: W&B is not installed, or could not start a run (the message names the key to change).
    """

    def __init__(self, out: Path, config: dict[str, Any], *, project: str = "digenrl", entity: str = "",
                 mode: str = "auto") -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
        self._wandb = wandb
        resolved, why = resolve_mode(mode)
        root = out / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        # Silent from the start (wandb.init prints hints, e.g. about Weave when openai is imported, before it reads
        # its own settings), and no Weave auto-tracing of the LLM judge's calls unless asked for.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        try:
            wandb.setup(settings=wandb.Settings(silent=True))
            self.run: Any = wandb.init(project=project, entity=entity or None, name=out.name, dir=str(out),
                                       config=config, id=run_id, resume="allow",
                                       mode=resolved,  # type: ignore[arg-type]  # (WANDB_MODE's value, as W&B reads it)
                                       settings=wandb.Settings(console="off", silent=True))
        except Exception as exc:  # wandb's own errors (a bad key, a server that refuses) are many classes
            raise ConfigError(f"log.wandb: W&B could not start a run in {resolved} mode ({why}): {exc}; set "
                              "log.wandb_mode = 'offline' to keep it on disk, or log.wandb = false") from None
        self.mode = resolved
        where = f"{root} (sync it later: wandb sync {root}/offline-run-*)" if resolved == "offline" else \
            getattr(self.run, "url", "") or project
        log.info("W&B: %s run %s, %s; %s", resolved, run_id, why, where)

    def log(self, data: dict[str, Any], step: int) -> None:
        """Numbers of ``data`` at ``step`` (a nested map becomes ``key/sub``; ``None`` and text are left out)."""
        if self.run is None:
            return
        flat: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict):
                flat.update({f"{key}/{k}": v for k, v in value.items() if _number(v)})
            elif _number(value):
                flat[key] = value
        if flat:
            self.run.log(flat, step=step)

    def image(self, key: str, array: Any, step: int, caption: str = "",
              scalars: dict[str, float] | None = None) -> None:
        """An ``[H, W, 3]`` uint8 picture (and ``scalars``) at ``step``."""
        if self.run is None:
            return
        self.run.log({key: self._wandb.Image(array, caption=caption or None), **(scalars or {})}, step=step)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
                # and its service process, which writes the offline run's records: finish() may return before
                # the last of them reach the file (seen with wandb 0.31), teardown() waits for them
                self._wandb.teardown()
            except Exception as exc:  # a run that ends on a signal: its files are what was written until now
                log.warning("W&B: finishing the run failed (%s)", exc)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and value is not None
