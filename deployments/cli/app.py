"""The ``forgeflow`` typer app, its sub-apps and what every command shares: the environment set
before Prefect is imported, the store opened read-only, one-line failures, stop signals."""

from __future__ import annotations

import inspect
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a long-running command (``forgeflow ui``, ``forgeflow demo``)."""


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread so the command unwinds as on Ctrl-C: its context
    managers (and Prefect's flow engine, which reports the run as crashed) and, at exit, the atexit
    handlers (Prefect's temporary server) run. SIGTERM's default action would skip all of them."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def raise_stopped(signum: int) -> None:
    """The ``on_first`` of :func:`stop_signals` for a command that unwinds: raise :class:`Stopped`."""
    raise Stopped(signum)


@contextmanager
def stop_signals(on_first: Callable[[int], None]) -> Iterator[list[tuple[float, int]]]:
    """Catch :data:`STOP_SIGNALS` in the main thread while inside.

    The first one calls ``on_first(signum)`` (it may raise, e.g. :func:`raise_stopped`); every one is
    recorded. A handler another library installs inside (Prefect's flow engine turns SIGTERM into
    ``TerminationSignal`` while a flow runs, then re-sends it to the handler it found: this one)
    comes back to this one. On leaving, the previous handlers come back when no signal came; after
    one, this handler stays (it only records), so a second signal cannot cut the exit path
    (atexit handlers) short.

    Args:
        on_first: called with the first signal's number.

    Yields:
        The signals received: (``time.monotonic()`` s, signal number), first first.
    """
    received: list[tuple[float, int]] = []

    def handler(signum: int, _frame: object) -> None:
        received.append((time.monotonic(), signum))
        if len(received) == 1:
            on_first(signum)

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield received
    finally:
        if not received:
            for signum, old in previous.items():
                signal.signal(signum, old)


_LIST_ITEM = re.compile(r"^\s*([-*]|\d+[.)])\s|^\s{2,}")
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(?=\s|$)")


def reflow(doc: str) -> str:
    """A docstring as help text that rich can wrap: each prose paragraph on one line (so it wraps at the
    terminal's width, never mid-sentence at the source's line breaks), lists and indented blocks kept
    line by line, rich markup escaped (a literal ``[x]`` stays visible).

    Args:
        doc: the docstring (indented or not).

    Returns:
        The paragraphs, separated by one blank line.
    """
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    out = []
    for para in paragraphs:
        lines = para.splitlines()
        keep = any(_LIST_ITEM.match(line) for line in lines)
        out.append(escape("\n".join(lines) if keep else " ".join(line.strip() for line in lines)))
    return "\n\n".join(out)


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line (a command's line in ``--help``).

    Args:
        doc: the docstring.

    Returns:
        The text up to and including the first full stop that ends a sentence (not "e.g."), or the
        whole first paragraph when it has none.
    """
    para = " ".join(line.strip() for line in inspect.cleandoc(doc).split("\n\n")[0].splitlines())
    end = _SENTENCE_END.search(para)
    return para if end is None else para[:end.end()]


def readable_help(typer_app: typer.Typer) -> None:
    """Make ``--help`` readable for every command of ``typer_app`` and its sub-apps, in place: a
    command's help is its docstring reflowed (:func:`reflow`; typer's rich mode keeps the source's
    line breaks), its line in the command list its ``short_help`` or else its docstring's first
    sentence (:func:`first_sentence`; typer lists the whole first paragraph). Call it once every
    command is registered.

    Args:
        typer_app: the app whose ``registered_commands`` and ``registered_groups`` are changed.
    """
    for info in typer_app.registered_commands:
        doc = info.help if info.help is not None else inspect.getdoc(info.callback)
        if doc:
            info.help = reflow(doc)
            info.short_help = info.short_help or escape(first_sentence(doc))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            readable_help(group.typer_instance)
