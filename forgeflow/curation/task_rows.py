"""The task rows a stage runs on: the user's candidates (JSONL or a HF dataset) or the lifecycle's
generated file, read the same way by the ``curate`` and ``canary`` flows.

A row's test specification is the row's own, else the ``test_specs`` entry for its repository
(``test_commands`` for the command alone), else the pinned project's (``forgeflow/data/projects.json``).
Log parsers are SWE-bench's registered ones (``swebench.harness.log_parsers``,
:data:`forgeflow.sandbox.verifier.LOG_PARSERS`); None reads forgeflow's structured pytest report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.curation.candidates import CandidateTask, load_candidates
from forgeflow.curation.generated import GeneratedTask, load_generated
from forgeflow.registry import projects


class TestSpec(BaseModel):
    """How one repository's tests run and are read."""

    __test__ = False  # not a pytest test class
    model_config = ConfigDict(frozen=True, extra="forbid")

    test_command: str = Field(min_length=1, description="the command run in /testbed (e.g. python3 -m unittest -v)")
    log_parser: str | None = Field(None, description="a SWE-bench log parser by name; None: forgeflow's pytest report")


class DatasetSource(BaseModel):
    """A HF ``datasets`` split of SWE-bench / SWE-smith / SWE-Gym style rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(min_length=1,
        description="a save_to_disk folder, or what datasets.load_dataset takes (Hub id, builder, data folder)")
    split: str = Field("test", description="the split to read")
    revision: str | None = Field(None,
        description="the dataset revision for load_dataset (pin it); ignored for a saved folder")


class TaskRows(BaseModel):
    """Loaded task rows with what each needs to run."""

    model_config = ConfigDict(frozen=True)

    rows: list[CandidateTask | GeneratedTask] = Field(description="the rows, in file order")
    test_commands: dict[str, str] = Field(description="instance id -> the test command its trials run in /testbed")
    log_parsers: dict[str, str | None] = Field(default_factory=dict,
        description="instance id -> its log parser name, or None (forgeflow's pytest report)")
    image_ids: dict[str, str | None] = Field(
        description="instance id -> the local image id or registry digest keying its image, else None")
    source: str = Field(description="the file, folder or dataset read")


class TaskSource(BaseModel):
    """Where a stage's task rows come from: a candidates JSONL, a HF split or a generated-candidates file,
    plus per-repository test specifications (a flow parameter group).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates_path: Path | None = Field(None,
        description="the user's candidates JSONL (instance_id, repo, patch, image_ref or image, problem_statement, "
                    "...)")
    dataset: DatasetSource | None = Field(None,
        description="the same rows as a HF datasets split, instead of candidates_path")
    generated_path: Path | None = Field(None,
        description="a generated-candidates file (default: forgeflow demo's), when neither above is given")
    test_commands: dict[str, str] | None = Field(None,
        description="repo -> test command, for repositories that are not pinned projects")
    test_specs: dict[str, TestSpec] | None = Field(None,
        description="repo -> test command and SWE-bench log parser; wins over test_commands")
    images: Literal["local", "registry"] = Field("local", description="generated rows only: run the local task "
                                                 "image (local) or the lifecycle's pushed copy (registry)")

    def load(self, default_generated: Path, stage: str) -> TaskRows:
        """The rows (:func:`load_task_rows`; ``stage`` names the caller in errors).

        Raises:
            InputError: as :func:`load_task_rows`.
        """
        return load_task_rows(self.candidates_path, self.generated_path, default_generated, self.test_commands,
                              stage=stage, dataset=self.dataset, test_specs=self.test_specs, images=self.images)


def _dataset_rows(source: DatasetSource) -> list[dict[str, Any]]:
    """The split's rows as plain dicts (``image_name`` read as ``image``)."""
    import datasets

    path = Path(source.path)
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if source.split not in loaded:
                    raise InputError(f"dataset {source.path}: no split {source.split!r}; its splits: "
                                     f"{sorted(loaded)}")
                loaded = loaded[source.split]
        else:
            loaded = datasets.load_dataset(source.path, split=source.split, revision=source.revision)
    except InputError:
        raise
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise InputError(f"dataset {source.path} (split {source.split!r}, revision {source.revision!r}) "
                         f"cannot be read: {type(exc).__name__}: {exc}") from exc
    rows = []
    for row in loaded:
        row = dict(row)
        if not row.get("image_ref") and not row.get("image") and row.get("image_name"):
            row["image_ref"] = row["image_name"]
        rows.append(row)
    return rows


def _raw_rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            if isinstance(raw, dict):
                out.append(raw)
    return out


def _candidate_specs(label: str, raw_rows: list[dict[str, Any]], rows: list[CandidateTask],
                     specs: Mapping[str, TestSpec]) -> tuple[dict[str, str], dict[str, str | None]]:
    """instance id -> test command and -> log parser: the row's, else ``specs[repo]``, else the
    pinned project's (pytest)."""
    from forgeflow.sandbox.verifier import LOG_PARSERS

    own = {r["instance_id"]: r for r in raw_rows if isinstance(r.get("instance_id"), str)}
    commands: dict[str, str] = {}
    parsers: dict[str, str | None] = {}
    lacking: set[str] = set()
    unknown: set[str] = set()
    for row in rows:
        raw = own.get(row.instance_id, {})
        spec = specs.get(row.repo)
        command = raw.get("test_command") if isinstance(raw.get("test_command"), str) else None
        command = (command or "").strip() or (spec.test_command if spec else None)
        if command is None:
            try:
                command = projects.get_project(row.repo).test_command
            except InputError:
                lacking.add(row.repo)
                continue
        parser = raw.get("log_parser") if isinstance(raw.get("log_parser"), str) else None
        parser = parser or (spec.log_parser if spec else None)
        if parser is not None and parser not in LOG_PARSERS:
            unknown.add(parser)
        commands[row.instance_id], parsers[row.instance_id] = command, parser
    if lacking:
        raise InputError(f"{label}: no test_command for repos {sorted(lacking)[:20]}: give it per row "
                         "(key test_command) or in test_specs / test_commands (repo -> command)")
    if unknown:
        raise InputError(f"{label}: unknown log parser(s) {sorted(unknown)}; valid: {', '.join(sorted(LOG_PARSERS))}")
    return commands, parsers


def load_task_rows(candidates_path: Path | None, generated_path: Path | None, default_generated: Path,
                   test_commands: Mapping[str, str] | None = None, stage: str = "curate",
                   dataset: DatasetSource | None = None,
                   test_specs: Mapping[str, TestSpec] | None = None,
                   images: Literal["local", "registry"] = "local") -> TaskRows:
    """Read the rows of ``candidates_path``, of ``dataset`` or of ``generated_path`` (default ``default_generated``).

    Args:
        test_commands: repo -> test command for repositories that are not pinned projects (overrides a
            generated row's command).
        stage: the stage named in error messages.
        images: generated rows only: ``registry`` makes each row's ``image`` its ``registry_ref``.

    Raises:
        InputError: more than one source given, no file at the path, a dataset that cannot be read
            or lacks the split, a malformed row (named by row/line), a repository without a test
            command, an unknown log parser (the valid ones listed), ``images="registry"`` with the
            user's rows or for generated rows the lifecycle never pushed (listed).
    """
    given = [name for name, value in (("candidates_path", candidates_path), ("dataset", dataset),
                                      ("generated_path", generated_path)) if value is not None]
    if len(given) > 1:
        raise InputError(f"{stage}: give one of candidates_path, dataset, generated_path; got {', '.join(given)}")
    specs = {repo: TestSpec(test_command=command) for repo, command in (test_commands or {}).items()}
    specs.update(test_specs or {})
    if images == "registry" and (candidates_path is not None or dataset is not None):
        raise InputError(f"{stage}: images='registry' applies to generated rows only (the lifecycle's pushed "
                         f"task images); {given[0]} rows name their own image")
    if candidates_path is not None or dataset is not None:
        if dataset is not None:
            raw_rows, label = _dataset_rows(dataset), f"dataset {dataset.path}[{dataset.split}]"
        else:
            raw_rows, label = None, str(candidates_path)
        rows = list(load_candidates(raw_rows if raw_rows is not None else candidates_path, name=label))
        raw_rows = raw_rows if raw_rows is not None else _raw_rows(Path(candidates_path))
        image_names = {r["instance_id"]: r["image_name"] for r in raw_rows
                       if isinstance(r.get("image_name"), str) and r["image_name"] and not r.get("image_ref")
                       and not r.get("image")}
        rows = [r.model_copy(update={"image_ref": image_names[r.instance_id]}) if r.instance_id in image_names else r
                for r in rows]  # SWE-bench's image_name, when the row has no image
        commands, parsers = _candidate_specs(label, raw_rows, rows, specs)
        return TaskRows(rows=rows, test_commands=commands, log_parsers=parsers,
                        image_ids={r.instance_id: None for r in rows}, source=label)
    path = Path(generated_path or default_generated)
    if not path.is_file():
        raise InputError(f"{stage}: no candidates file at {path}: run the lifecycle (`forgeflow demo`) to write it, "
                         "or give candidates_path (the candidates JSONL), dataset or generated_path")
    generated = load_generated(path)
    image_ids = {r.instance_id: r.image_id for r in generated}
    if images == "registry":
        unpushed = [r.instance_id for r in generated if r.registry_ref is None]
        if unpushed:
            raise InputError(f"{stage}: images='registry', but {len(unpushed)} row(s) of {path} have no registry_ref "
                             f"(never pushed by the lifecycle): {', '.join(unpushed[:10])}")
        generated = [r.model_copy(update={"image_ref": r.registry_ref}) for r in generated]
        image_ids = {r.instance_id: r.registry_digest for r in generated}
    return TaskRows(rows=list(generated),
                    test_commands={r.instance_id: specs[r.repo].test_command if r.repo in specs else r.test_command
                                   for r in generated},
                    log_parsers={r.instance_id: specs[r.repo].log_parser if r.repo in specs else None
                                 for r in generated},
                    image_ids=image_ids, source=str(path))
