"""``forgeflow recover`` (void exactly what an infrastructure fault broke) and ``forgeflow derived build|verify``."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer

from deployments.cli.app import app, console, derived_app, fail, prepare_env, read_store
from forgeflow.curation import derived_store


def _parse_instant(text: Optional[str], option: str) -> Optional[datetime]:
    """ISO 8601 instant (``2026-12-01T10:00:00+00:00``) or None; a bad text exits 2 naming ``option``."""

    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        fail(f"{option} {text!r} is not an ISO 8601 instant (e.g. 2026-12-01T10:00:00+00:00)")
    return None  # unreachable: fail exits


_RECOVER_FLAGS = {"batch_ids": "--batch", "batch ids": "--batch ids", "trial_ids": "--trial",
                  "trial ids": "--trial ids", "exception_type": "--exception-type", "since": "--since",
                  "until": "--until", "reason": "--reason", "include_rejections": "--include-rejections"}


_RECOVER_FIELD = re.compile(r"(?<![\w-])(" + "|".join(sorted(_RECOVER_FLAGS, key=len, reverse=True)) + r")(?!\w)")


def _recover_flags(message: str) -> str:
    """``message`` from :class:`~forgeflow.curation.recovery.RecoveryRequest` / ``plan_recovery`` with each
    field name (``batch_ids``, ``since``, ...) replaced by the flag the user typed (``--batch``,
    ``--since``, ...). Quoted values ('...') are left as they are."""
    parts = re.split(r"('[^']*')", message)
    return "".join(part if part.startswith("'") else _RECOVER_FIELD.sub(lambda m: _RECOVER_FLAGS[m.group(1)], part)
                   for part in parts)


def _check_exception_type(name: str) -> None:
    """Exit 2 when ``name`` (``--exception-type``) is neither recorded on any trial in the store
    (void ones included) nor a forgeflow exception class (:mod:`forgeflow.common.errors`): a typo must not
    read as "nothing to recover". The message lists the exception types the store has."""
    from forgeflow.common import errors  # noqa: PLC0415

    known = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.ForgeflowError)}
    if name in known:
        return
    store = read_store()
    try:
        recorded = sorted({t.exception_type for t in store.trials_for(include_void=True) if t.exception_type})
    finally:
        store.dispose()
    if name not in recorded:
        fail(f"--exception-type {name!r} is not recorded on any trial in the store {store.display_url} nor a "
              f"forgeflow exception class; the store has: {', '.join(recorded) or 'none'}")


@app.command()
def recover(
    batch: Optional[list[str]] = typer.Option(None, "--batch", help="batch id whose trials to select (repeatable)"),
    trial: Optional[list[str]] = typer.Option(None, "--trial", help="trial id to select (repeatable)"),
    exception_type: Optional[str] = typer.Option(None, help="select trials that ended in this exception class "
                                                 "(needs --since and --until)"),
    since: Optional[str] = typer.Option(None, help="window start, ISO 8601 with timezone (inclusive)"),
    until: Optional[str] = typer.Option(None, help="window end, ISO 8601 with timezone (exclusive)"),
    reason: Optional[str] = typer.Option(None, help="why (stored on every voided trial; required with --apply)"),
    apply: bool = typer.Option(False, "--apply", help="run the recover flow: back up, void, requeue, audit"),
    backup_dir: Optional[Path] = typer.Option(None, help="backup folder (default $FORGEFLOW_HOME/recovery)"),
    include_rejections: bool = typer.Option(False, "--include-rejections",
                                            help="also void and requeue REJECTED tasks whose every live NOP/Oracle "
                                                 "trial is selected (a rejection an infrastructure fault caused); "
                                                 "only with --batch/--trial"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Void exactly the trials an infrastructure fault broke and requeue their tasks.

    A dry run by default (reads the store only, no Prefect server): lists the trials that would be
    voided, the tasks that would be requeued and the selected trials kept (real outcomes).
    ``--apply`` runs the ``recover`` flow (backup with sha256, one transaction with counts
    verified, audit artifact). ``--include-rejections`` also voids the rewarded NOP/Oracle trials
    of rejected tasks named by the ids (accepted tasks and rejections outside the ids stay)."""
    prepare_env(create=apply)
    from pydantic import ValidationError  # noqa: PLC0415

    from forgeflow.common.errors import ForgeflowError, validation_problems  # noqa: PLC0415
    from forgeflow.curation.recovery import RecoveryRequest, plan_recovery, render_plan  # noqa: PLC0415

    if apply and not (reason or "").strip():
        fail("--apply needs --reason (it is stored on every voided trial and requeued task)")
    start, end = _parse_instant(since, "--since"), _parse_instant(until, "--until")
    try:
        request = RecoveryRequest(batch_ids=batch or [], trial_ids=trial or [], exception_type=exception_type,
                                  since=start, until=end, reason=reason or "dry run",
                                  include_rejections=include_rejections)
    except ValidationError as exc:
        fail(_recover_flags(validation_problems(exc)))
    if request.exception_type is not None:
        _check_exception_type(request.exception_type)
    if not apply:
        store = read_store()  # a dry run reads only: a missing store is an error, never created
        try:
            plan = plan_recovery(store, request)
        except ForgeflowError as exc:
            fail(f"{type(exc).__name__}: {_recover_flags(str(exc))}")
        if as_json:
            print(json.dumps({
                "dry_run": True, "plan_sha256": plan.plan_sha256,
                "void": [{"trial_id": t.trial_id, "instance_id": t.instance_id, "kind": t.kind,
                          "exception_type": t.exception_type, "reward": t.reward, "batch_id": t.batch_id,
                          "created_at": t.created_at.isoformat() if t.created_at else None} for t in plan.void],
                "requeue": [{"instance_id": t.instance_id, "status": t.status, "reason": t.reason}
                            for t in plan.requeue],
                "kept": [k.model_dump() for k in plan.kept],
                "before": plan.before.model_dump(), "expected_after": plan.expected_after.model_dump()}, indent=2))
            return
        console.print(render_plan(plan), highlight=False, soft_wrap=True)
        console.print("dry run: nothing changed; add --apply --reason TEXT to do it")
        return
    from flows.curate import recover as recover_flow  # noqa: PLC0415

    try:
        out = recover_flow(request.model_copy(update={"dry_run": False, "backup_dir": backup_dir}))
    except ForgeflowError as exc:
        fail(exc)
    if as_json:
        print(out.model_dump_json(indent=2))
        return
    console.print(f"recovery {out.recovery_id}: {out.voided} trial(s) voided, {out.requeued} task(s) "
                  f"requeued; backup {out.backup_path} sha256 {out.backup_sha256}", highlight=False,
                  soft_wrap=True)


def _derived_sources(store: "object", freeze_name: Optional[str], freezes_dir: Path,
                     id_lists: list[str]) -> list:
    """The source sets a definition may name: one per store task status (``accepted``,
    ``rejected``, ``error``, ``candidate``), ``images_available``, ``frozen``/``frozen.<split>``
    for ``--freeze``, and each ``--id-list NAME=PATH@REVISION``."""
    from forgeflow.common.errors import InputError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415
    from forgeflow.curation.freeze import manifest_path  # noqa: PLC0415

    sources = [derived.store_status_set(status, store, status)
               for status in ("accepted", "rejected", "error", "candidate")]
    sources.append(derived.store_images_available_set("images_available", store))
    if freeze_name is not None:
        recorded = store.get_freeze(freeze_name)
        path = Path(recorded.manifest_path) if recorded is not None else manifest_path(freeze_name, freezes_dir)
        sources.extend(derived.frozen_split_sets(path, prefix="frozen").values())
    for spec in id_lists:
        name, sep, rest = spec.partition("=")
        path, sep2, revision = rest.rpartition("@")
        if not sep or not sep2 or not name or not path or not revision:
            raise InputError(f"--id-list {spec!r}: expected NAME=PATH@REVISION (e.g. solved=ids.txt@abc123)")
        sources.append(derived.id_list_set(name, Path(path), revision))
    return sources


def _derived_json(item: "object", path: Path) -> dict:
    return {"name": item.name, "path": str(path), "count": item.count, "ids_sha256": item.ids_sha256,
            "expression": item.expression, "split_counts": item.split_counts,
            "inputs": {k: {"kind": v.kind, "count": v.count, "ids_sha256": v.ids_sha256}
                       for k, v in item.inputs.items()}}


@derived_app.command("build", short_help="Build a derived task set (set algebra) and record its inputs' digests.")
def derived_build(
    name: str,
    definitions: Optional[Path] = typer.Option(None, help="file of 'name = expression' lines "
                                               "(default $FORGEFLOW_HOME/derived/definitions.txt)"),
    define: Optional[list[str]] = typer.Option(None, "--define", help="a definition 'name = expression' "
                                               "(repeatable; instead of --definitions)"),
    freeze: Optional[str] = typer.Option(None, help="a freeze name: its splits are the sets frozen, frozen.train, ..."),
    id_list: Optional[list[str]] = typer.Option(None, "--id-list", help="an external id list NAME=PATH@REVISION "
                                                "(.json list or one id per line; repeatable)"),
    out_dir: Optional[Path] = typer.Option(None, help="where NAME.json goes (default $FORGEFLOW_HOME/derived)"),
    freezes_dir: Optional[Path] = typer.Option(None, help="default $FORGEFLOW_HOME/demo/freezes"),
    replace: bool = typer.Option(False, "--replace", help="replace an existing NAME.json whose content differs "
                                 "(the old file is kept under OUT_DIR/replaced/)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Evaluate derived set NAME over the store's task sets (accepted, rejected, error, candidate,
    images_available), a freeze's splits and external id lists; write NAME.json with the digests
    of its inputs (rebuild and check it with `forgeflow derived verify NAME`). An identical rebuild
    changes nothing; one with other content is refused (exit 2, saying what NAME.json holds)
    unless --replace. The store is only read: a missing one is an error (exit 2), never created.
    NAME is a plain name (no path separators or '..')."""
    home = prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415

    try:
        derived.validate_derived_name(name)
        if define and definitions is not None:
            fail("give --definitions or --define, not both")
        if define:
            text = "\n".join(define)
        else:
            source = definitions or home / "derived" / "definitions.txt"
            if not source.is_file():
                fail(f"no definitions: {source} does not exist; give --definitions FILE or --define 'name = expr'")
            text = source.read_text(encoding="utf-8")
        parsed = derived.parse_definitions(text)
        if name not in parsed.expressions:
            fail(f"derived set {name!r} is not defined; defined: {', '.join(parsed.expressions) or 'none'}")
        store = read_store()
        sources = _derived_sources(store, freeze, freezes_dir or home / "demo" / "freezes", id_list or [])
        item = derived.derive(parsed, sources)[name]
        saved = derived_store.save_derived(item, out_dir or home / "derived", replace=replace)
    except ForgeflowError as exc:
        fail(exc)
    path, old = saved.path, saved.previous
    replaced = None if saved.previous_path is None else {
        "path": str(saved.previous_path), "count": None if old is None else old.count,
        "ids_sha256": None if old is None else old.ids_sha256}
    if as_json:
        print(json.dumps({**_derived_json(item, path), "written": saved.written, "replaced": replaced}, indent=2))
        return
    splits = "; ".join(f"{f}: " + ", ".join(f"{s} {n}" for s, n in c.items()) for f, c in item.split_counts.items())
    done = f"written to {path}" if saved.written else f"unchanged in {path} (identical rebuild)"
    if replaced is not None:
        was = "" if old is None else f"{old.count} ids, sha256 {old.ids_sha256}; "
        done += f" (replaced {was}previous file kept at {saved.previous_path})"
    console.print(f"derived {item.name} = {item.expression}: {item.count} ids, sha256 {item.ids_sha256}"
                  + (f" ({splits})" if splits else "") + f"; {done}", highlight=False, soft_wrap=True)


@derived_app.command("verify")
def derived_verify(
    name: str,
    out_dir: Optional[Path] = typer.Option(None, help="where NAME.json is (default $FORGEFLOW_HOME/derived)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Rebuild derived set NAME from its recorded inputs (store, freeze manifest, id-list files)
    and check every digest; exit 2 naming each changed input otherwise."""
    home = prepare_env(create=False)
    from forgeflow.common.errors import ForgeflowError  # noqa: PLC0415
    from forgeflow.curation import derived  # noqa: PLC0415

    try:
        path = (out_dir or home / "derived") / f"{derived.validate_derived_name(name)}.json"
        store = read_store()
        item = derived_store.verify_derived(path, store=store)
    except ForgeflowError as exc:
        fail(exc)
    if as_json:
        print(json.dumps({"ok": True, **_derived_json(item, path)}, indent=2))
        return
    console.print(f"derived {item.name}: OK ({item.count} ids, sha256 {item.ids_sha256}; "
                  f"{len(item.inputs)} input(s) unchanged)", highlight=False, soft_wrap=True)
