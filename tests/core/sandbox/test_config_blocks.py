"""The blocks that configure a core config are that config plus Block (issue 35): ``forgeflow-sandbox`` is a
SandboxTarget with SandboxLimits, ``forgeflow-dispatcher`` a RayPlacement with a kind, ``forgeflow-model-store`` a
HubTarget with a kind, a folder and a Secret block's name; each hands out the plain config (what tasks take and
cache on), and a document saved with the old fields still loads (pure logic, no Prefect server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from blocks.core import ModelStore, SandboxBackend, TrialDispatcher
from forgeflow.common.errors import InputError
from forgeflow.packaging.publish import HubTarget
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.dispatch import RayPlacement
from forgeflow.sandbox.limits import SandboxLimits


def test_the_sandbox_block_is_the_target_and_the_limits() -> None:
    assert issubclass(SandboxBackend, SandboxTarget) and issubclass(SandboxBackend, SandboxLimits)
    assert set(SandboxBackend.model_fields) == set(SandboxTarget.model_fields) | set(SandboxLimits.model_fields)
    assert list(SandboxBackend.model_json_schema()["properties"]) == [  # the UI's form: the order it always had
        "kind", "memory_mb", "cpus", "namespace", "kubeconfig", "context", "image_pull_secret", "labels"]
    saved = {"kind": "kubernetes", "memory_mb": 768, "cpus": 0.5, "namespace": "trials", "kubeconfig": "/k",
             "context": "c", "image_pull_secret": None}  # a document saved before the block had labels
    block = SandboxBackend.model_validate(saved)
    target, limits = block.target(), block.limits()
    assert type(target) is SandboxTarget and type(limits) is SandboxLimits  # what tasks cache on
    assert target == SandboxTarget(kind="kubernetes", namespace="trials", kubeconfig="/k", context="c")
    assert limits == SandboxLimits(memory_mb=768, cpus=0.5)
    assert target.as_backend() is target and SandboxTarget(labels={"a": "b"}).as_backend() == "podman"  # as recorded
    assert (block.spec().memory_mb, block.spec().network) == (768, False)
    with pytest.raises(ValidationError, match="unknown sandbox backend 'firecracker'; valid kinds: kubernetes, podman"):
        SandboxBackend(kind="firecracker")
    with pytest.raises(ValidationError, match="memory_mb"):
        SandboxBackend(memory_mb=8)


def test_the_dispatcher_block_is_a_ray_placement_with_a_kind() -> None:
    assert issubclass(TrialDispatcher, RayPlacement)
    assert list(TrialDispatcher.model_json_schema()["properties"]) == [
        "kind", "address", "resource", "per_trial", "max_retries"]
    assert TrialDispatcher().placement() is None  # in-process: no address needed
    placement = TrialDispatcher(kind="ray", address="10.0.0.1:6379", per_trial=0.5).placement()
    assert type(placement) is RayPlacement  # what a Ray task and a cache key get, never the block
    assert placement == RayPlacement(address="10.0.0.1:6379", per_trial=0.5)
    with pytest.raises(InputError, match="needs an address"):
        TrialDispatcher(kind="ray").placement()
    with pytest.raises(ValidationError, match="per_trial"):
        TrialDispatcher(kind="ray", address="10.0.0.1:6379", per_trial=0)


def test_the_model_store_block_is_a_hub_target_with_a_kind() -> None:
    assert issubclass(ModelStore, HubTarget)
    assert list(ModelStore.model_json_schema()["properties"]) == [
        "kind", "path", "repo_id", "endpoint", "revision", "token_secret", "private", "transfer"]
    store = ModelStore(kind="hf_hub", repo_id="forgeflow/tiny", revision="release", transfer="lfs").validate_kind()
    hub = HubTarget.model_validate(store.model_dump(include=set(HubTarget.model_fields)))
    assert hub == HubTarget(repo_id="forgeflow/tiny", revision="release", transfer="lfs")
    assert ModelStore().validate_kind().kind == "local"  # local: no repo_id needed
    with pytest.raises(InputError, match="needs repo_id 'namespace/name'"):
        ModelStore(kind="hf_hub").validate_kind()
    with pytest.raises(ValidationError, match="transfer"):
        ModelStore(kind="hf_hub", repo_id="forgeflow/tiny", transfer="ftp")
