"""The lifecycle refuses, before it writes anything, inputs that cannot reach its goal: a freeze name already
used with other inputs, a base model folder that is no checkpoint, a serving endpoint it cannot start.

Found by a new-user trial: `forgeflow demo --candidates 3` after a default demo ran generation and
prewarm for a minute, rewrote the shared candidates file (the canary of the existing freeze then
failed its preflight) and summary.json, and only then failed at the freeze stage."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_used_freeze_name_with_other_inputs_fails_before_any_stage(prefect_harness, tmp_path: Path) -> None:
    from flows.lifecycle import lifecycle
    from forgeflow.common.errors import FreezeConflictError
    from forgeflow.config import LifecycleConfig
    from forgeflow.curation.freeze import manifest_path, record_freeze_inputs

    out = tmp_path / "demo"
    freezes = out / "freezes"
    freezes.mkdir(parents=True)
    manifest_path("demo-v1", freezes).write_text("{}")
    record_freeze_inputs("demo-v1", freezes, LifecycleConfig().freeze_inputs())
    before = {p: p.read_bytes() for p in freezes.iterdir()}

    with pytest.raises(FreezeConflictError, match="candidates_per_project: 5 then, 3 now"):
        lifecycle(LifecycleConfig(output_dir=out, candidates_per_project=3))
    assert [p.name for p in out.iterdir()] == ["freezes"]  # no summary.json, candidates, registries
    assert {p: p.read_bytes() for p in freezes.iterdir()} == before


def test_a_base_model_folder_that_is_no_checkpoint_fails_before_any_stage(prefect_harness, tmp_path: Path) -> None:
    from flows.lifecycle import lifecycle
    from forgeflow.common.errors import InputError
    from forgeflow.config import LifecycleConfig

    out, folder = tmp_path / "run", tmp_path / "team-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(InputError, match=r"team-model.*no weights.*no tokenizer"):
        lifecycle(LifecycleConfig(output_dir=out, base_model={"local_dir": str(folder)}))
    assert not out.exists()  # no registry, image, candidate or summary was made


def test_an_external_serving_block_is_refused_before_any_stage(prefect_harness, tmp_path: Path) -> None:
    """The lifecycle serves the GGUFs it builds: an endpoint it does not start cannot load them."""
    from blocks.core import ServingBackend
    from flows.lifecycle import lifecycle
    from forgeflow.common.errors import InputError
    from forgeflow.config import LifecycleConfig

    ServingBackend(kind="external", base_url="http://127.0.0.1:9/v1", model_alias="team-model").save(
        "team-endpoint", overwrite=True)
    out = tmp_path / "run"
    with pytest.raises(InputError, match=r"serving block 'team-endpoint' is kind 'external' \(http://127.0.0.1:9/v1\)"):
        lifecycle(LifecycleConfig(output_dir=out, serving={"block": "team-endpoint"}))
    assert not out.exists()


def test_a_serving_block_saved_with_values_its_model_refuses_is_named_before_any_stage(prefect_harness,
                                                                                        tmp_path: Path) -> None:
    """The UI's block form checks types, not BackendConfig's rules: such a block is refused where it is loaded,
    naming the block and the field, not as a missing block."""
    from blocks.core import ServingBackend
    from flows.lifecycle import lifecycle
    from forgeflow.common.errors import InputError
    from forgeflow.config import LifecycleConfig

    ServingBackend.model_construct(n_parallel=4).save("form-made", overwrite=True)  # as the form saves it
    out = tmp_path / "run"
    with pytest.raises(InputError, match=r"serving block 'form-made' is not valid: n_parallel need kind "
                                         r"'llama-server'"):
        lifecycle(LifecycleConfig(output_dir=out, serving={"block": "form-made"}))
    assert not out.exists()
