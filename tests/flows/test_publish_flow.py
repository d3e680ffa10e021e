"""The release step in Prefect: publishing a checked GGUF and its lineage JSON to a ModelStore block.

Runs the real ``publish`` flow (GGUF check, then :func:`tasks.packaging.publish_gguf`) on the cached
tiny Q8_0 GGUF of ``tests/integration/test_serving.py`` (the whole ``package`` chain takes over a
minute here, so its publish wiring is tested up to the preflight that runs before any compute).
The HF Hub cannot be reached from the test machines: the Hub store is ``tests/fakes/hf_hub.py``, a
loopback fake of the Hub HTTP API driven by the real ``huggingface_hub`` client, and its token
lives only in a Prefect Secret block. The flow run's logs, parameters and artifacts are read back
through the Prefect client and must not contain the token.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError, ModelStoreError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from tests.fakes.hf_hub import FakeHub
from tests.helpers import tiny_ggufs

pytestmark = [pytest.mark.slow]

TOKEN = "hf_" + secrets.token_hex(16)  # made per run: no token-shaped literal in the repository
BAD_TOKEN = "hf_" + secrets.token_hex(16)
REPO = "forgeflow/tiny-release"


def _run_records(flow_run_id) -> list[str]:
    """Every log message, the parameters and the artifacts of one flow run (and its task runs)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the logs still queued in this process reach the API first

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            run = await client.read_flow_run(flow_run_id)
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        return ([log.message for log in logs] + [json.dumps(run.parameters, default=str)]
                + [json.dumps(a.data, default=str) for a in artifacts])

    return asyncio.run(read())


def test_publish_to_local_store_and_hub_without_leaking_the_token(prefect_harness, tmp_path: Path) -> None:
    from prefect.blocks.system import Secret

    from blocks.core import ModelStore
    from flows.stages import PublishParams, publish

    q8, _ = tiny_ggufs()
    hf_dir = q8.parent / "hf"
    gguf = tmp_path / "release" / "tiny-Q8_0.gguf"
    gguf.parent.mkdir()
    shutil.copyfile(q8, gguf)

    # local directory store (the default kind)
    ModelStore(path=tmp_path / "models").save("test-local-store", overwrite=True)
    state = publish(PublishParams(gguf_path=gguf, store="test-local-store", hf_dir=hf_dir, model_name="tiny"), return_state=True)
    local = state.result()
    folder = Path(local.location)
    assert folder.parent == (tmp_path / "models" / "tiny").resolve()
    assert sha256_file(folder / gguf.name) == sha256_file(q8)
    lineage = json.loads((folder / "tiny-Q8_0.lineage.json").read_text())
    assert lineage["gguf_sha256"] == sha256_file(q8) and lineage["quantization"] == "Q8_0"
    assert lineage["hf_sha256"] == sha256_tree(hf_dir) and lineage["adapter_sha256"] is None
    assert lineage["run_id"] == str(state.state_details.flow_run_id)
    assert {f.role for f in local.files} == {"gguf", "metadata"}
    # with the checkpoint: the weights the GGUF came from travel in the same revision, each verified
    carried = publish(PublishParams(gguf_path=gguf, store="test-local-store", hf_dir=hf_dir, model_name="tiny", include_checkpoint=True))
    checkpoint = {f.path_in_store: f.sha256 for f in carried.files if f.role == "checkpoint"}
    assert checkpoint == {f"checkpoint/{p.relative_to(hf_dir).as_posix()}": sha256_file(p)
                          for p in sorted(hf_dir.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    assert sha256_tree(Path(carried.location) / "checkpoint") == sha256_tree(hf_dir)
    assert carried.revision != local.revision

    # HF Hub store: the token only in a Secret block
    hub = FakeHub(token=TOKEN)
    hub.start()
    try:
        Secret(value=TOKEN).save("test-hub-token", overwrite=True)
        ModelStore(kind="hf_hub", repo_id=REPO, endpoint=hub.endpoint, token_secret="test-hub-token",
                   transfer="lfs").save("test-hub-store", overwrite=True)
        state = publish(PublishParams(gguf_path=gguf, store="test-hub-store", hf_dir=hf_dir, model_name="tiny"), return_state=True)
        record = state.result()
        assert record.backend == "hf_hub" and record.revision == hub.head(REPO)
        assert hub.stored_bytes(REPO, gguf.name) == q8.read_bytes()
        stored = json.loads(hub.stored_bytes(REPO, "tiny-Q8_0.lineage.json"))
        assert stored["gguf_sha256"] == sha256_file(q8) and stored["run_id"] == str(state.state_details.flow_run_id)
        assert ("POST", f"/api/models/{REPO}/commit/main") in hub.requests  # the token was sent and accepted
        # a token the Hub refuses: the run fails with the server's 401, logged with its traceback
        Secret(value=BAD_TOKEN).save("test-hub-bad-token", overwrite=True)
        ModelStore(kind="hf_hub", repo_id=REPO, endpoint=hub.endpoint, token_secret="test-hub-bad-token",
                   transfer="lfs").save("test-hub-store-bad", overwrite=True)
        failed = publish(PublishParams(gguf_path=gguf, store="test-hub-store-bad", hf_dir=hf_dir, model_name="tiny"), return_state=True)
        assert failed.is_failed()
        with pytest.raises(ModelStoreError, match="401"):
            failed.result()
    finally:
        hub.stop()

    texts = _run_records(state.state_details.flow_run_id)
    assert any("test-hub-token" in t for t in texts)  # the logs name the Secret block...
    assert any(record.revision in t for t in texts)  # ...and what was published
    assert not [t for t in texts if TOKEN in t or TOKEN[3:] in t]  # ...never the token
    texts = _run_records(failed.state_details.flow_run_id)
    assert any("401" in t for t in texts)  # the failure and its traceback are in the run's logs...
    assert not [t for t in texts if BAD_TOKEN in t or BAD_TOKEN[3:] in t]  # ...without the token


def test_package_publish_preflight_fails_before_any_compute(prefect_harness, tmp_path: Path) -> None:
    from blocks.core import ModelStore
    from flows.stages import PackageParams, package

    out_dir = tmp_path / "out"
    hf_dir = tiny_ggufs()[0].parent / "hf"
    with pytest.raises(InputError, match="^params.store: model store block 'no-such-store' does not exist"):
        package(PackageParams(hf_dir=hf_dir, out_dir=out_dir, quantizations=("Q8_0",), store="no-such-store"))
    ModelStore(kind="hf_hub", endpoint="http://127.0.0.1:9").save("test-hub-no-repo", overwrite=True)
    with pytest.raises(InputError, match="^params.store: model store kind hf_hub needs repo_id"):
        package(PackageParams(hf_dir=hf_dir, out_dir=out_dir, quantizations=("Q8_0",), store="test-hub-no-repo"))
    assert not out_dir.exists()  # nothing was converted


def test_publish_reads_its_store_block_in_a_task_and_names_the_field(prefect_harness, tmp_path: Path) -> None:
    """The block is a Prefect API read: a task run of the flow run (``model-store-<name>``), before any file is
    hashed; a missing block fails the run naming ``params.store``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.stages import PublishParams, publish

    gguf = tiny_ggufs()[0]
    state = publish(PublishParams(gguf_path=gguf, store="no-such-store", hf_dir=gguf.parent / "hf"),
                    return_state=True)
    assert state.is_failed()
    with pytest.raises(InputError, match="^params.store: model store block 'no-such-store' does not exist"):
        state.result()
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert [(t.name, t.state.type.value) for t in runs] == [("model-store-no-such-store", "FAILED")]
