"""``forgeflow work-pool template|apply``: the Kubernetes work pools of :mod:`deployments.work_pool`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from deployments.cli.app import app, console, fail, prepare_env

work_pool_app = typer.Typer(help="Kubernetes work pools (k8s, k8s-gpu): base job templates and their pools.",
                            no_args_is_help=True)
app.add_typer(work_pool_app, name="work-pool")

_POOL = typer.Option("k8s", "--pool", help="k8s (CPU) or k8s-gpu")
_BLOCK = typer.Option(None, "--result-storage-block",
                      help="block-type/block-name slug of the result storage block (default: "
                           "remote-file-system/forgeflow-results)")


@work_pool_app.command("template", short_help="Print or write a Kubernetes work pool's base job template.")
def template(pool: str = _POOL, result_storage_block: Optional[str] = _BLOCK,
             out: Optional[Path] = typer.Option(None, "--out", help="write here instead of printing"),
             write_infra: bool = typer.Option(False, "--write-infra",
                                              help="write both committed templates in infra/k8s/")) -> None:
    """Print (or write) a pool's base job template: prefect-kubernetes's default with forgeflow's
    settings merged, validated by prefect-kubernetes before it is written."""
    prepare_env(create=False)
    from deployments import work_pool  # noqa: PLC0415
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.common.fsutil import atomic_write_text  # noqa: PLC0415

    if write_infra and result_storage_block:
        fail("--write-infra writes the committed templates, with the default result storage block; "
             "drop --result-storage-block or use --out")
    block = result_storage_block or work_pool.RESULT_STORAGE_BLOCK
    try:
        if write_infra:
            for name, path in work_pool.TEMPLATE_FILES.items():
                rendered = work_pool.base_job_template(name, block)
                work_pool.validate_template(rendered)
                atomic_write_text(path, work_pool.template_text(rendered))
                console.print(f"wrote {path}")
            return
        rendered = work_pool.base_job_template(pool, block)
        work_pool.validate_template(rendered)
    except InputError as exc:
        fail(exc)
    text = work_pool.template_text(rendered)
    if out is None:
        print(text, end="")
        return
    atomic_write_text(out, text)
    console.print(f"wrote {out}")


@work_pool_app.command("apply")
def apply(pool: str = _POOL, name: Optional[str] = typer.Option(None, help="work pool name (default: --pool)"),
          result_storage_block: Optional[str] = _BLOCK) -> None:
    """Create or update the Kubernetes work pool through the Prefect API (PREFECT_API_URL); the result
    storage block must exist first."""
    prepare_env(create=False)
    from deployments import work_pool  # noqa: PLC0415
    from forgeflow.common.errors import InputError  # noqa: PLC0415

    try:
        outcome = work_pool.apply_work_pool(pool, name, result_storage_block or work_pool.RESULT_STORAGE_BLOCK)
    except InputError as exc:
        fail(exc)
    console.print(f"work pool {name or pool!r} {outcome} (type kubernetes)")
