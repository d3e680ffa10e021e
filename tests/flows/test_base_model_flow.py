"""The ``base-model`` flow: the team's own base checkpoint, from a local folder or an HF Hub repository
at a revision, checked and recorded in the store before any stage trains or packages it.

The HF Hub cannot be reached from the test machines: the Hub is ``tests/fakes/hf_hub.py``, a loopback
fake of the Hub HTTP API (repo info, tree, ``resolve`` downloads) driven by the real
``huggingface_hub`` client (``upload_folder`` to put the model there, ``snapshot_download`` in the
flow). The token lives only in a Prefect Secret block. The checkpoint is the cached seed-0 tiny
model (a real Qwen2 config, safetensors weights and tokenizer).
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.ledger.store import Store
from tests.fakes.hf_hub import FakeHub
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.slow]

TOKEN = "hf_" + secrets.token_hex(16)  # made per run: no token-shaped literal in the repository
REPO = "team/tiny-base"


@pytest.fixture
def home(flow_home: Path) -> Path:
    return flow_home


def _tiny_checkpoint() -> Path:
    return tiny_ggufs()[0].parent / "hf"


def test_local_folder_is_checked_recorded_and_refused_when_incomplete(prefect_harness, home: Path,
                                                                      tmp_path: Path) -> None:
    from flows.stages import BaseModelParams, base_model
    from forgeflow.packaging.checkpoint import BaseModelSource

    folder = tmp_path / "team-model"
    shutil.copytree(_tiny_checkpoint(), folder)
    record = base_model(BaseModelParams(source=BaseModelSource(local_dir=folder)))
    assert record.path == folder.resolve() and record.source == "local"
    assert record.sha256 == sha256_tree(folder) and record.model_type == "qwen2"
    assert 40_000_000 < record.num_parameters < 41_000_000  # the tiny model: 40.5 M (tied embedding once)
    [stored] = Store().producers(record.sha256)
    assert stored.kind == "base" and stored.path == str(folder.resolve())
    assert stored.lineage == {"source": "local", "model_type": "qwen2"}

    (folder / "config.json").unlink()
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(InputError, match=r"team-model.*no config\.json.*no weights"):
        base_model(BaseModelParams(source=BaseModelSource(local_dir=folder)))
    with pytest.raises(InputError, match="does not exist"):
        base_model(BaseModelParams(source=BaseModelSource(local_dir=tmp_path / "missing")))
    with pytest.raises(InputError, match=r"give params\.source\.local_dir or params\.source\.repo_id"):
        base_model(BaseModelParams(source=BaseModelSource()))


def test_hub_repository_at_a_revision_is_fetched_with_the_secret_token(prefect_harness, home: Path) -> None:
    from huggingface_hub import HfApi, constants
    from prefect.blocks.system import Secret
    from pydantic import ValidationError

    from flows.stages import BaseModelParams, base_model
    from forgeflow.packaging.checkpoint import BaseModelSource

    source_dir = _tiny_checkpoint()
    hub = FakeHub(token=TOKEN)
    hub.start()
    saved_xet = constants.HF_HUB_DISABLE_XET
    try:
        constants.HF_HUB_DISABLE_XET = True  # the fake speaks Git LFS, not Xet storage
        api = HfApi(endpoint=hub.endpoint, token=TOKEN)
        api.create_repo(REPO)
        first = api.upload_folder(repo_id=REPO, folder_path=source_dir).oid
        api.upload_file(repo_id=REPO, path_or_fileobj=b"{}", path_in_repo="extra.json")  # main moves on
        Secret(value=TOKEN).save("test-base-model-token", overwrite=True)

        record = base_model(BaseModelParams(source=BaseModelSource(
            repo_id=REPO, revision=first, token_secret="test-base-model-token", endpoint=hub.endpoint)))
        assert record.source == "hub" and record.commit == first and record.revision == first
        fetched = {p.relative_to(record.path).as_posix() for p in record.path.rglob("*") if p.is_file()}
        assert "extra.json" not in fetched  # exactly the pinned commit, not main
        for path in source_dir.rglob("*"):
            if path.is_file():
                assert sha256_file(record.path / path.relative_to(source_dir)) == sha256_file(path)
        assert record.path.is_relative_to(home / "models" / "hub")
        [stored] = Store().producers(record.sha256)
        assert stored.lineage["commit"] == first and stored.lineage["repo_id"] == REPO

        # a branch resolves to the commit it points at now
        on_main = base_model(BaseModelParams(source=BaseModelSource(
            repo_id=REPO, revision="main", token_secret="test-base-model-token", endpoint=hub.endpoint)))
        assert on_main.commit == hub.head(REPO) != first and on_main.sha256 != record.sha256

        with pytest.raises(InputError, match="no such revision"):
            base_model(BaseModelParams(source=BaseModelSource(
            repo_id=REPO, revision="v9", token_secret="test-base-model-token", endpoint=hub.endpoint)))
        Secret(value="hf_" + secrets.token_hex(16)).save("test-base-model-bad-token", overwrite=True)
        with pytest.raises(InputError, match="HTTP 401"):
            base_model(BaseModelParams(source=BaseModelSource(
            repo_id=REPO, revision="main", token_secret="test-base-model-bad-token", endpoint=hub.endpoint)))
        with pytest.raises(InputError, match="no-such-secret"):
            base_model(BaseModelParams(source=BaseModelSource(
            repo_id=REPO, revision="main", token_secret="no-such-secret", endpoint=hub.endpoint)))
        with pytest.raises(ValidationError, match="needs a revision"):
            BaseModelSource(repo_id=REPO)
    finally:
        constants.HF_HUB_DISABLE_XET = saved_xet
        hub.stop()
