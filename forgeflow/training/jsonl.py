"""Training inputs a user brings as JSONL files: SFT chat samples and RL tasks, checked line by line.

:func:`read_sft_jsonl` reads rows ``{"messages": [{"role", "content"}, ...]}`` (optional
``instance_id``, ``source``; content may hold image parts kept beside the file) into the samples
:func:`forgeflow.training.burst.build_sft_dataset`
takes; :func:`read_rl_jsonl` reads :class:`forgeflow.training.rl.RLTask` rows. A bad line is an
:class:`~forgeflow.common.errors.InputError` naming the file and the line (1-based), raised before
any model is loaded.
"""

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


def read_sft_jsonl(path: Path) -> list[dict[str, Any]]:
    """SFT samples from a JSONL file of chat rows.

    Args:
        path: one JSON object per line with ``messages`` (a non-empty list of ``{"role",
            "content"}``, content a string or a list of parts ``{"type": "text", "text"}`` / ``{"type": "image",
            "image": <path relative to the JSONL, or the sha256 of a file beside it>}``, images in user turns;
            roles system/user/assistant/tool, at least one assistant turn; ``tool_calls``
            / ``tool_call_id`` kept) or with ``prompt`` + ``completion`` (the format the ``windows``
            flow writes: the completion is what is learnt), and optionally ``instance_id`` (default
            ``<file stem>:<line>``) and ``source`` (default ``jsonl``). One format per file. Blank
            lines are skipped.

    Returns:
        Samples ``{"messages" | "prompt", "completion", "instance_id", "source"}`` in file order; each image part
        ``{"type": "image", "image": <absolute path>, "sha256": <hex>}``
        (:func:`forgeflow.training.sample_images.resolve_images`).

    Raises:
        InputError: the file is missing or empty, or a line is not a valid sample (the message
            names the file, the line and the field; an image file missing, not an image, or named by a sha256
            its bytes do not have).
    """
    samples = []
    for number, row in _rows(path, "samples_jsonl"):
        body = ({"messages": row.get("messages")} if "messages" in row or "prompt" not in row
                else {"prompt": row.get("prompt"), "completion": row.get("completion")})
        try:  # image refs: relative to the JSONL's folder, or the sha256 of a file beside it
            body = sample_images.resolve_images(body, Path(path).resolve().parent)
        except InputError as exc:
            raise InputError(f"samples_jsonl {path} line {number}: {exc}") from None
        sample = {**body, "instance_id": row.get("instance_id", f"{Path(path).stem}:{number}"),
                  "source": row.get("source", "jsonl")}
        if samples and ("messages" in samples[0]) != ("messages" in sample):
            kinds = ["messages" if "messages" in s else "prompt + completion" for s in (sample, samples[0])]
            raise InputError(f"samples_jsonl {path} line {number}: a {kinds[0]} row in a file of {kinds[1]} rows: "
                             "one format per file")
        try:
            build_sft_dataset([sample])
        except InputError as exc:
            detail = str(exc).replace("samples[0].", "")
            raise InputError(f"samples_jsonl {path} line {number}: {detail}") from None
        samples.append(sample)
    return samples


def _field_error(error: Any) -> str:
    """One pydantic error of an RL task row as ``field: message``; an unknown field spelt like a known
    one in another case (``FAIL_TO_PASS``, SWE-bench's spelling) says which field it means."""
    where = ".".join(str(p) for p in error["loc"]) or "row"
    text = f"{where}: {error['msg']}"
    if error["type"] == "extra_forbidden":
        known = {name.lower(): name for name in RLTask.model_fields}
        if where.lower() in known:
            text += f" (the field is {known[where.lower()]})"
    return text


def read_rl_jsonl(path: Path) -> list[dict[str, Any]]:
    """RL tasks from a JSONL file of :class:`~forgeflow.training.rl.RLTask` rows.

    Args:
        path: one JSON object per line: ``instance_id``, ``image_ref`` (the task image),
            ``problem_statement``, ``test_command``, ``fail_to_pass`` (test ids, at least one),
            ``pass_to_pass`` (test ids), optionally ``task_timeout_s`` (the task's original per-task
            timeout, seconds, default SWE-smith's 3000; its former name ``verifier_timeout_s`` is read
            too), ``pristine_duration_s`` (its longest recorded pristine run, seconds) and ``known_tests``
            (every test id its pristine runs collected); no other field.

    Returns:
        The tasks as dicts (validated), in file order.

    Raises:
        InputError: the file is missing or empty, a line is not a valid task (file, line and the
            fields named: an unknown or misspelt field, an empty ``fail_to_pass``), or an
            ``instance_id`` repeats.
    """
    tasks: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for number, row in _rows(path, "tasks_jsonl"):
        try:
            task = RLTask.model_validate(row)
        except ValidationError as exc:
            fields = "; ".join(_field_error(e) for e in exc.errors())
            raise InputError(f"tasks_jsonl {path} line {number} is not an RL task: {fields}") from None
        if task.instance_id in seen:
            raise InputError(f"tasks_jsonl {path} line {number}: instance_id {task.instance_id!r} repeats line "
                             f"{seen[task.instance_id]}")
        seen[task.instance_id] = number
        tasks.append(task.model_dump(mode="json"))
    return tasks
