"""The ``forgeflow`` command line (typer).

``forgeflow demo`` runs the lifecycle flow on the embedded default and prints its summary;
``forgeflow ui`` starts the Prefect UI on the same Prefect database; ``forgeflow freeze verify``
recomputes a freeze's digests; ``forgeflow recover`` lists (dry run) or, with ``--apply``, voids the
trials an infrastructure fault broke and requeues their tasks; ``forgeflow derived build|verify``
writes and checks derived task sets (:mod:`forgeflow.curation.derived`); ``forgeflow work-pool
template|apply`` writes the Kubernetes work pools' base job templates or creates/updates a pool
(:mod:`deployments.work_pool`). The app and what the
commands share is :mod:`deployments.cli.app`; the commands are in :mod:`.run`, :mod:`.records`,
:mod:`.curation`, :mod:`.up_down` and :mod:`.work_pool`. Prefect's environment
(PREFECT_HOME under FORGEFLOW_HOME, analytics off, a startup timeout that suits a 2-core machine)
is set before Prefect is imported.
"""

from __future__ import annotations

from rich.console import Console

from deployments.cli.app import app

# the command modules register their commands on the app when imported, in the order of --help
# isort: off
from deployments.cli import run, records, curation, up_down, work_pool  # noqa: F401, E402
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    """The ``forgeflow`` console entry point: the typer app, with known errors as one line.

    Bad input (:class:`~forgeflow.common.errors.InputError`, e.g. a malformed store URL; a path that is a
    folder, unreadable or not UTF-8; a file that does not validate) prints one ``error:`` line and
    exits 2; an infrastructure failure (:class:`~forgeflow.common.errors.InfraError`,
    or a database the store URL points to that cannot be reached) prints one line and exits 1.
    Anything else is a bug and keeps its traceback.
    """
    from pydantic import ValidationError
    from sqlalchemy.exc import OperationalError

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
