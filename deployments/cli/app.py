"""The ``forgeflow`` typer app, its sub-apps and what every command shares: the environment set
before Prefect is imported, the store opened read-only, one-line failures."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

from forgeflow.ledger.store import Store

app = typer.Typer(help="forgeflow: the post-training lifecycle of an LLM coding agent as Prefect flows.",
                  no_args_is_help=True)
freeze_app = typer.Typer(help="Frozen datasets.")
app.add_typer(freeze_app, name="freeze")
derived_app = typer.Typer(help="Derived task sets (set algebra over store, frozen and external sets).")
app.add_typer(derived_app, name="derived")
console = Console()


def prefect_env(home: Path) -> dict[str, str]:
    """Prefect settings for a forgeflow home: its own PREFECT_HOME (the UI reads the same
    database), analytics off, a generous ephemeral-server startup timeout (27-39 s on
    two busy cores). Values the user already set win."""
    defaults = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240",
        "PREFECT_UI_ENABLED": "true",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def prepare_env(create: bool = True) -> Path:
    """Export FORGEFLOW_HOME (resolved) and Prefect's environment; with ``create`` (commands that
    write: flows, servers) also make PREFECT_HOME. Read-only commands pass False so a mistyped
    home leaves nothing behind."""
    home = Path(os.environ.get("FORGEFLOW_HOME", ".forgeflow")).resolve()
    os.environ["FORGEFLOW_HOME"] = str(home)
    os.environ.update(prefect_env(home))
    if create:
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes only the leaf
    return home


def read_store() -> "Store":
    """The store for a command that only reads it; nothing is ever written or created. Exits 2
    with one line naming the store when it does not exist (a mistyped FORGEFLOW_HOME or
    FORGEFLOW_STORE_URL), is not a forgeflow store (not SQLite, or no forgeflow schema: a 0-byte
    file stays 0 bytes) or is at an older schema revision: that store is *not* migrated here — the
    message says to run any flow or `forgeflow up`, which migrate it. A database server that
    cannot be reached exits 1 naming the masked URL and its setting (:class:`Store` ``create=False``)."""
    from forgeflow.common.errors import InfraError, InputError  # noqa: PLC0415
    from forgeflow.ledger.store import Store  # noqa: PLC0415

    try:
        return Store(create=False)
    except InputError as exc:
        fail(exc)
    except InfraError as exc:  # also inside commands that map ForgeflowError to exit 2
        fail(exc, status=1)
    raise AssertionError("unreachable: fail exits")


def fail(problem: object, status: int = 2) -> None:
    """One line on stderr and exit ``status`` (2: bad input; 1: infrastructure), no traceback."""
    text = f"{type(problem).__name__}: {problem}" if isinstance(problem, Exception) else str(problem)
    Console(stderr=True).print(f"[red]error:[/red] {text}", highlight=False, soft_wrap=True)
    raise typer.Exit(status)
