"""The ``forgeflow`` command line (typer).

``forgeflow demo`` runs the lifecycle flow on the embedded default and prints its summary;
``forgeflow ui`` starts the Prefect UI on the same Prefect database; ``forgeflow freeze verify``
recomputes a freeze's digests; ``forgeflow rescore JOB`` re-verifies a canary job's stored submissions
under the current verifier as a new linked job (:mod:`.rescore`); ``forgeflow rl-tasks FREEZE`` writes a freeze
split's RL task rows with their recorded known tests (:mod:`.rl_tasks`); ``forgeflow recover`` lists (dry run)
or, with ``--apply``, voids the trials an infrastructure fault broke and requeues their tasks;
``forgeflow derived build|verify`` writes and checks derived task sets (:mod:`forgeflow.curation.derived`);
``forgeflow work-pool template|apply`` writes the Kubernetes work pools' base job templates or creates/updates a pool
(:mod:`deployments.work_pool`). The app and what the
commands share is :mod:`deployments.cli.app`; the commands are in :mod:`.run`, :mod:`.records`,
:mod:`.rescore`, :mod:`.rl_tasks`, :mod:`.curation`, :mod:`.up_down` and :mod:`.work_pool`. Prefect's environment
(PREFECT_HOME under FORGEFLOW_HOME, analytics off, a startup timeout that suits a 2-core machine)
is set before Prefect is imported.
"""

from __future__ import annotations

from rich.console import Console

from deployments.cli.app import app, readable_help

# the command modules register their commands on the app when imported, in the order of --help
# isort: off
from deployments.cli import run, records, rescore, rl_tasks, curation, up_down, work_pool  # noqa: F401, E402
# isort: on

readable_help(app)

__all__ = ["app", "main"]


def main() -> None:
    """The ``forgeflow`` console entry point: the typer app, with known errors as one line.

    Bad input (:class:`~forgeflow.common.errors.InputError`, e.g. a malformed store URL; a path that is a
    folder, unreadable or not UTF-8; a file that does not validate) prints one ``error:`` line and
    exits 2; an infrastructure failure (:class:`~forgeflow.common.errors.InfraError`,
    or a database the store URL points to that cannot be reached) prints one line and exits 1.
    A store that answers but cannot be read (a damaged SQLite file: "database disk image is malformed")
    prints one ``StoreInvalidError`` line naming the store and how SQLite recovers one, and exits 2.
    Anything else is a bug and keeps its traceback.
    """
    from pydantic import ValidationError
    from sqlalchemy.exc import DatabaseError, OperationalError

    from forgeflow.common.errors import InfraError, InputError

    def one_line(exc: BaseException, status: int) -> SystemExit:
        lines = str(exc).splitlines()
        text = " ".join(lines[:3]) if isinstance(exc, ValidationError) else (lines[0] if lines else "")
        Console(stderr=True).print(f"[red]error:[/red] {type(exc).__name__}: {text}", highlight=False, soft_wrap=True)
        return SystemExit(status)

    try:
        app()
    except (InfraError, OperationalError, ConnectionError) as exc:
        raise one_line(exc, 1) from None
    except (InputError, ValidationError, UnicodeDecodeError, OSError) as exc:
        # a path that is a folder, missing, unreadable or not UTF-8 text, or a file of the wrong kind
        raise one_line(exc, 2) from None
    except DatabaseError as exc:  # after OperationalError, its subclass: the database answered, its data did not
        if type(exc) is not DatabaseError:  # IntegrityError, ProgrammingError...: a bug, with its traceback
            raise
        raise one_line(_damaged_store(exc), 2) from None


def _damaged_store(exc: BaseException) -> Exception:
    """A :class:`~forgeflow.common.errors.StoreInvalidError` naming the store (password masked) that raised
    ``exc`` while being read, what the database said, and for SQLite the way back (a backup, or SQLite's
    ``.recover``: https://www.sqlite.org/recovery.html)."""
    from sqlalchemy.engine import make_url

    from forgeflow.common.errors import StoreInvalidError
    from forgeflow.common.settings import store_url

    url = make_url(store_url())
    said = str(getattr(exc, "orig", None) or exc).splitlines()[0]
    if url.get_backend_name() == "sqlite":
        return StoreInvalidError(f"the forgeflow store {url.database} cannot be read: {said}; restore it from a "
                                 f"backup, or copy out what is left with `sqlite3 {url.database} .recover`")
    return StoreInvalidError(f"the forgeflow store {url.render_as_string(hide_password=True)} cannot be read: {said}")
