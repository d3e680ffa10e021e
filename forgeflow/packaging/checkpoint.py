"""The base checkpoint a team trains and packages: the demo's tiny model, a local folder, or an HF
Hub repository at a pinned revision (fetched as exactly one commit, named in the record).

The Hub token comes only from the caller (a Prefect Secret block), never from the environment or a
local login (``token=False`` when there is none), and is never written into a message.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forgeflow.common.errors import InputError, TransientInfraError
from forgeflow.common.fsutil import sha256_tree

HUB_ENDPOINT = "https://huggingface.co"
"""The public HF Hub."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
T = TypeVar("T")


class BaseModelSource(BaseModel):
    """Where the base checkpoint comes from: nothing (the tiny model), ``tiny_vl``, ``local_dir``, or
    ``repo_id`` with ``revision``. The strings ``"tiny"`` and ``"tiny-vl"`` stand for the two tiny models.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    local_dir: Path | None = Field(None, description="a local checkpoint folder (used in place)")
    repo_id: str | None = Field(None, description="HF Hub model repository 'namespace/name'")
    revision: str | None = Field(None, description="Hub revision to fetch (commit sha, tag or branch)")
    token_secret: str | None = Field(None, description="name of the Prefect Secret block with the Hub token")
    endpoint: str = Field(HUB_ENDPOINT, description="HF Hub base URL")
    tiny_vl: bool = Field(False, description="the tiny Qwen3.5-shaped multimodal model (vision tower + mmproj)")

    @model_validator(mode="before")
    @classmethod
    def _named_tiny(cls, value: Any) -> Any:
        if value in ("tiny", "tiny-vl"):
            return {"tiny_vl": value == "tiny-vl"}
        if isinstance(value, str):
            raise ValueError(f"base model {value!r}: give 'tiny', 'tiny-vl', or {{local_dir}} / {{repo_id, revision}}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "BaseModelSource":
        if self.tiny_vl and (self.local_dir is not None or self.repo_id is not None):
            raise ValueError("base model: tiny_vl is a built model; give it without local_dir or repo_id")
        if self.local_dir is not None and self.repo_id is not None:
            raise ValueError("base model: give local_dir or repo_id, not both")
        if self.repo_id is not None:
            if not _REPO_ID.match(self.repo_id):
                raise ValueError(f"base model repo_id {self.repo_id!r} is not of the form 'namespace/name'")
            if not self.revision:
                raise ValueError(f"base model repo_id {self.repo_id!r} needs a revision (a commit sha, tag or "
                                 "branch): an unpinned model changes under the lineage")
        elif self.revision is not None or self.token_secret is not None:
            raise ValueError("base model: revision and token_secret go with repo_id")
        return self

    @property
    def kind(self) -> Literal["tiny", "tiny-vl", "local", "hub"]:
        """``tiny`` (the demo's model), ``tiny-vl`` (the tiny multimodal one), ``local`` or ``hub``."""
        return "hub" if self.repo_id else "local" if self.local_dir else "tiny-vl" if self.tiny_vl else "tiny"


class CheckpointRecord(BaseModel):
    """A checked base checkpoint folder."""

    model_config = ConfigDict(frozen=True)

    path: Path
    sha256: str = Field(min_length=64, max_length=64, description="sha256_tree of the folder")
    num_parameters: int = Field(ge=0,
        description="parameters from the safetensors headers (tied tensors once); 0 for PyTorch pickles")
    model_type: str = Field(description="config.json's model_type")
    source: Literal["local", "hub", "tiny-vl"] = Field(description="local, hub or tiny-vl (built here)")
    repo_id: str | None = Field(None, description="the Hub repository (None for a local folder)")
    revision: str | None = Field(None, description="the requested Hub revision")
    commit: str | None = Field(None, description="the commit the revision resolved to")

    @property
    def provenance(self) -> dict[str, str]:
        """``source``, ``model_type`` and, from the Hub, ``repo_id``/``revision``/``commit``: the
        lineage the store records for the base artifact."""
        fields = {"source": self.source, "repo_id": self.repo_id, "revision": self.revision,
                  "commit": self.commit, "model_type": self.model_type}
        return {k: v for k, v in fields.items() if v}


def _count_parameters(folder: Path) -> int:
    """Sum of tensor sizes over the folder's safetensors files, read from their headers only."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="np") as handle:
            for name in handle.keys():
                count = 1
                for dim in handle.get_slice(name).get_shape():
                    count *= dim
                total += count
    return total


def missing_parts(names: set[str]) -> list[str]:
    """What a checkpoint whose top-level file names are ``names`` lacks: ``config.json``, weights
    (``*.safetensors`` / ``pytorch_model*.bin``), a tokenizer file; empty when nothing is missing."""
    problems = []
    if "config.json" not in names:
        problems.append("no config.json")
    if not any(fnmatch.fnmatch(name, pattern) for name in names for pattern in _WEIGHTS):
        problems.append("no weights (*.safetensors or pytorch_model*.bin)")
    if not names & set(_TOKENIZER_FILES):
        problems.append(f"no tokenizer ({' / '.join(_TOKENIZER_FILES)})")
    return problems


def check_checkpoint(folder: Path, *, source: Literal["local", "hub", "tiny-vl"] = "local", repo_id: str | None = None,
                     revision: str | None = None, commit: str | None = None) -> CheckpointRecord:
    """Check that ``folder`` is an HF causal-LM checkpoint and record its digest (over every file).

    Raises:
        InputError: the folder is missing, or lacks a readable ``config.json`` with a ``model_type``,
            weights or a tokenizer file (the folder and every missing piece named).
    """
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise InputError(f"base model folder {str(folder)!r} does not exist or is not a folder")
    problems = missing_parts({entry.name for entry in folder.iterdir() if entry.is_file()})
    model_type = ""
    if "no config.json" not in problems:
        try:
            model_type = str(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type") or "")
            if not model_type:
                problems.append("config.json has no model_type")
        except (OSError, ValueError, AttributeError) as exc:
            problems.append(f"config.json is unreadable ({type(exc).__name__}: {exc})")
    if problems:
        raise InputError(f"base model folder {str(folder)!r} is not an HF checkpoint: {'; '.join(problems)}")
    return CheckpointRecord(path=folder, sha256=sha256_tree(folder), num_parameters=_count_parameters(folder),
                            model_type=model_type, source=source, repo_id=repo_id, revision=revision, commit=commit)


def preflight_source(source: BaseModelSource, token: str | None = None) -> str | None:
    """Check, before any compute and without reading weights, that ``source`` can give a checkpoint.

    Returns:
        The commit a Hub revision resolves to now (one ``repo_info`` call); None for a local or tiny model.

    Raises:
        InputError / TransientInfraError: as :func:`download_checkpoint`, or a missing part (named).
    """
    if source.kind in ("tiny", "tiny-vl"):
        return None
    if source.kind == "local":
        folder = Path(source.local_dir).expanduser()  # type: ignore[arg-type]
        if not folder.is_dir():
            raise InputError(f"base model local_dir {str(folder)!r} does not exist or is not a folder")
        problems = missing_parts({entry.name for entry in folder.iterdir() if entry.is_file()})
        if problems:
            raise InputError(f"base model local_dir {str(folder)!r} is not an HF checkpoint: {'; '.join(problems)}")
        return None
    commit, names = _hub_call(source, token, lambda api: _resolve(api, source))
    problems = missing_parts(names)
    if problems:
        raise InputError(f"base model {source.repo_id}@{source.revision} (commit {commit}) is not an HF "
                         f"checkpoint: {'; '.join(problems)}")
    return commit


def _resolve(api: Any, source: BaseModelSource) -> tuple[str, set[str]]:
    info = api.repo_info(source.repo_id, revision=source.revision)
    if not info.sha:
        raise InputError(f"base model {source.repo_id}@{source.revision}: the Hub named no commit for the revision")
    return info.sha, {s.rfilename for s in (info.siblings or []) if "/" not in s.rfilename}


def _hub_call(source: BaseModelSource, token: str | None, call: Callable[[Any], T]) -> T:
    """Run ``call(HfApi)`` and map what ``huggingface_hub`` raises to forgeflow's errors (token scrubbed)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{source.repo_id}@{source.revision} on {source.endpoint}"

    def scrub(text: str) -> str:
        return text.replace(token, "<redacted>") if token else text

    try:
        return call(HfApi(endpoint=source.endpoint, token=token or False))
    except RevisionNotFoundError as exc:
        raise InputError(f"base model {where}: no such revision") from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise InputError(f"base model {where}: no such repository, or the token may not read it "
                         f"({type(exc).__name__})") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        first = str(exc).splitlines()[0] if str(exc) else ""
        message = f"base model {where}: HTTP {status}: {scrub(first)}"
        if status is None or status == 429 or status >= 500:
            raise TransientInfraError(message) from exc
        raise InputError(message) from exc
    except Exception as exc:
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore"):
            # connection refused or reset, timeouts: the Hub did not answer
            raise TransientInfraError(f"base model {where}: {type(exc).__name__}: {scrub(str(exc))}") from exc
        raise


def download_checkpoint(source: BaseModelSource, out_root: Path, token: str | None = None) -> CheckpointRecord:
    """Fetch ``source``'s Hub repository at the commit its revision resolves to, then check it.

    ``snapshot_download`` of that commit into the ``huggingface_hub`` cache layout under ``out_root``
    (a commit already fetched is not fetched again); the digest covers ``.gitattributes`` too.

    Raises:
        InputError: ``source`` is not a Hub source; the repository, the revision or a file does not
            exist, or the token is refused (HTTP 401/403); the fetched folder is not a checkpoint.
        TransientInfraError: the Hub did not answer, or answered 429/5xx.
    """
    from huggingface_hub import snapshot_download

    if source.kind != "hub" or source.repo_id is None or source.revision is None:
        raise InputError(f"download_checkpoint needs a Hub source (repo_id + revision), got {source.kind}")
    commit, _ = _hub_call(source, token, lambda api: _resolve(api, source))
    local = _hub_call(source, token, lambda api: snapshot_download(
        source.repo_id, revision=commit, cache_dir=Path(out_root), endpoint=source.endpoint, token=token or False))
    return check_checkpoint(Path(local), source="hub", repo_id=source.repo_id, revision=source.revision, commit=commit)


def tiny_vl_checkpoint(out_dir: Path, seed: int = 0) -> CheckpointRecord:
    """Build (or reuse) the tiny multimodal model in ``out_dir`` and check it like a team's folder.

    Raises:
        InputError: as :func:`forgeflow.packaging.vl_model.build_tiny_vl_model` / :func:`check_checkpoint`.
    """
    from forgeflow.packaging.vl_model import build_tiny_vl_model

    return check_checkpoint(build_tiny_vl_model(Path(out_dir), seed=seed).path, source="tiny-vl")
