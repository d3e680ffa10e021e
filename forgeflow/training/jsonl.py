"""Training inputs a user brings as JSONL files, checked line by line before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from forgeflow.common.errors import InputError
from forgeflow.training import sample_images
from forgeflow.training.burst import build_sft_dataset
from forgeflow.training.rl import RLTask


def _rows(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line of ``path``.

    Raises:
        InputError: the file is missing, is not UTF-8, holds no rows, a line is not JSON or not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} is not a file")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise InputError(f"{what} {path} line {line} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                         f"offset {exc.start}): JSONL files are UTF-8") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{what} {path} line {number} is not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise InputError(f"{what} {path} line {number} is a JSON {type(row).__name__}, not an object")
        rows.append((number, row))
    if not rows:
        raise InputError(f"{what} {path} is empty: it needs at least one JSON row")
    return rows


def read_sft_jsonl(path: Path, field: str = "samples_jsonl") -> list[dict[str, Any]]:
    """SFT samples from a JSONL file of ``messages`` or ``prompt`` + ``completion`` rows, image parts resolved;
    each error begins with ``field``, the user's name for the file.

    Raises:
        InputError: the file is missing or empty, or a line is not a valid sample (file, line and field named).
    """
    samples = []
    for number, row in _rows(path, field):
        body = ({"messages": row.get("messages")} if "messages" in row or "prompt" not in row
                else {"prompt": row.get("prompt"), "completion": row.get("completion")})
        try:  # image refs: relative to the JSONL's folder, or the sha256 of a file beside it
            body = sample_images.resolve_images(body, Path(path).resolve().parent)
        except InputError as exc:
            raise InputError(f"{field} {path} line {number}: {exc}") from None
        sample = {**body, "instance_id": row.get("instance_id", f"{Path(path).stem}:{number}"),
                  "source": row.get("source", "jsonl")}
        if samples and ("messages" in samples[0]) != ("messages" in sample):
            kinds = ["messages" if "messages" in s else "prompt + completion" for s in (sample, samples[0])]
            raise InputError(f"{field} {path} line {number}: a {kinds[0]} row in a file of {kinds[1]} rows: "
                             "one format per file")
        try:
            build_sft_dataset([sample])
        except InputError as exc:
            detail = str(exc).replace("samples[0].", "")
            raise InputError(f"{field} {path} line {number}: {detail}") from None
        samples.append(sample)
    return samples


def _field_error(error: Any) -> str:
    """One pydantic error of an RL task row as ``field: message``; an unknown field spelt like a known
    one in another case (``Fail_To_Pass``) says which field it means."""
    where = ".".join(str(p) for p in error["loc"]) or "row"
    text = f"{where}: {error['msg']}"
    if error["type"] == "extra_forbidden":
        known = {name.lower(): name for name in RLTask.model_fields}
        if where.lower() in known:
            text += f" (the field is {known[where.lower()]})"
    return text


def read_rl_jsonl(path: Path, field: str = "tasks_jsonl") -> list[dict[str, Any]]:
    """RL tasks (validated :class:`~forgeflow.training.rl.RLTask` dicts) from a JSONL file, in file order; each
    error begins with ``field``, the user's name for the file.

    Raises:
        InputError: the file is missing or empty, a line is not a valid task, or an ``instance_id`` repeats.
    """
    tasks: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for number, row in _rows(path, field):
        try:
            task = RLTask.model_validate(row)
        except ValidationError as exc:
            fields = "; ".join(_field_error(e) for e in exc.errors())
            raise InputError(f"{field} {path} line {number} is not an RL task: {fields}") from None
        if task.instance_id in seen:
            raise InputError(f"{field} {path} line {number}: instance_id {task.instance_id!r} repeats line "
                             f"{seen[task.instance_id]}")
        seen[task.instance_id] = number
        tasks.append(task.model_dump(mode="json"))
    return tasks
