"""The standalone ``serve``, ``publish`` and ``package`` flows (flows/stages.py) keep the store as the
ledger, as the lifecycle does: ``serve`` records its generations (and ``forgeflow status`` shows
them, live, from the serve flow's state file), generation numbers stay unique across the serve
flow's and the demo's state files (a rolled-back swap is recorded under a number of its own), the GGUF
is checked against its HF config before any server starts, a busy first port is skipped when nothing serves,
``publish`` refuses a checkpoint the store says the GGUF was not converted from, and ``package``
records its artifacts with its run as their producer (and applies typed metadata edits, recording the
edited files).

Real llama-cpp-python servers on the tiny GGUFs (tests/helpers.py), free loopback ports, the
session Prefect harness, a store per test (``flow_store_url``); the tests that only read what one ``package`` run on
a quantization plan wrote and recorded share that run, in its own home and store (``plan_run``, once per module).
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_tree
from forgeflow.ledger.records import ModelArtifactRecord
from forgeflow.ledger.store import Store
from forgeflow.serving import bluegreen
from forgeflow.serving.backend import BackendConfig
from tests.flows.conftest import PREFECT_DB
from tests.helpers import free_port, pid_alive, tiny_ggufs

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def home(tmp_path: Path, flow_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh FORGEFLOW_HOME whose store is ``flow_store_url`` (upgraded)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FORGEFLOW_HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STORE_URL", flow_store_url)
    Store().upgrade()
    return home


MIXED_PLAN = "Q4_K_M+attn-embd-output-Q8_0"
"""The hand-run pipeline's served mix, by its plan name."""
TEAM_SPEC = {"preset": "Q8_0", "tensor_types": {r"ffn_(up|gate)\.weight$": "F16"}, "name": "q8-ffn-f16"}
"""A team's own quantization spec."""


class PlanRun(NamedTuple):
    """What :func:`plan_run`'s ``package`` run produced: its checkpoint, flow run id, artifacts and store."""

    hf_dir: Path
    run_id: str
    artifacts: dict[str, Any]
    store_url: str


@pytest.fixture(scope="module")
def plan_run(prefect_harness, request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlanRun]:
    """One ``package`` run of the tiny checkpoint on :data:`MIXED_PLAN` and :data:`TEAM_SPEC`, in a FORGEFLOW_HOME
    and store of its own (SQLite, or a fresh database on the Prefect cluster as ``flow_store_url``'s): the
    tests that only read what it wrote and recorded share it (convert, two quantizations, three checks and
    loads: a minute or more on two busy cores)."""
    from flows.stages import PackageParams, package

    root = tmp_path_factory.mktemp("plan-run")
    (root / "home").mkdir()
    hf_dir = tiny_ggufs()[0].parent / "hf"
    cluster = database = None
    if PREFECT_DB == "sqlite":
        store_url = f"sqlite:///{root / 'store.db'}"
    else:
        from tests.pgfixtures import fresh_database

        cluster = request.getfixturevalue("prefect_pg_cluster")
        database = fresh_database(cluster, prefix="store")
        store_url = cluster.url(database, driver="postgresql+psycopg")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FORGEFLOW_HOME", str(root / "home"))
            mp.setenv("FORGEFLOW_STORE_URL", store_url)
            Store().upgrade()
            state = package(PackageParams(hf_dir=hf_dir, out_dir=root / "out", quantizations=(MIXED_PLAN, TEAM_SPEC)),
                            return_state=True)
            artifacts = state.result().artifacts
        yield PlanRun(hf_dir, str(state.state_details.flow_run_id), artifacts, store_url)
    finally:
        if database is not None:
            from tests.pgfixtures import drop_database

            drop_database(cluster, database)


def test_serve_records_its_generations_and_status_shows_the_live_one(prefect_harness, home: Path) -> None:
    from deployments.cli import app
    from flows.stages import ServeParams, serve

    q8, f16 = tiny_ggufs()
    hf_dir = q8.parent / "hf"  # the checkpoint both GGUFs were converted from (the store does not know them)
    # what the demo left behind: its own state file, generation 7 stopped, another GGUF
    demo_state = home / "demo" / "serving" / "state.json"
    demo_state.parent.mkdir(parents=True)
    demo_state.write_text(json.dumps({"generation": 7, "active_port": 8802, "gguf_path": str(q8),
                                      "gguf_sha256": "d" * 64, "pid": None}))
    state_path = home / "serving" / "state.json"
    ports = (free_port(), free_port())
    with pytest.raises(InputError, match=r"params\.gguf_path '.*nope\.gguf' is not a file"):
        serve(ServeParams(gguf_path=home / "nope.gguf", ports=ports))
    busy = socket.socket()
    busy.bind(("127.0.0.1", ports[0]))
    busy.listen()
    try:
        first = serve(ServeParams(gguf_path=q8, ports=ports, hf_dir=hf_dir), return_state=True)
        # nothing was serving and a foreign process held the first port: the other one is used
        assert first.result().current.active_port == ports[1]
    finally:
        busy.close()
    try:
        second = serve(ServeParams(gguf_path=f16, ports=ports, hf_dir=hf_dir), return_state=True)
        out = second.result()
        assert not out.rolled_back and out.current.generation == 2 and out.current.active_port == ports[0]
        rows = Store().serving_generations()
        assert [(g.generation, g.status, g.gguf_sha256) for g in rows] == [
            (1, "retired", sha256_file(q8)), (2, "active", sha256_file(f16))]
        # the second run retired generation 1 and made generation 2: both rows carry its run id
        assert rows[0].run_id == rows[1].run_id == str(second.state_details.flow_run_id)
        assert first.state_details.flow_run_id != second.state_details.flow_run_id

        result = CliRunner().invoke(app, ["status", "--json"])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.output)["serving"]
        assert shown == {"generation": 2, "port": ports[0], "gguf_sha256": sha256_file(f16), "status": "active",
                         "live": True, "state_path": str(state_path)}
        text = CliRunner().invoke(app, ["status"]).output
        assert f"serving:   generation 2 on port {ports[0]} (live), gguf sha256 {sha256_file(f16)}" in text
        # `down` only names a model server (`up` did not start it); `down --serving` stops it
        said = CliRunner().invoke(app, ["down"]).output
        assert f"generation 2 on port {ports[0]}" in said and "`forgeflow down --serving` stops it" in said
        assert pid_alive(out.current.pid)
        said = CliRunner().invoke(app, ["down", "--serving"]).output
        assert f"model server: generation 2 on port {ports[0]} (pid {out.current.pid}) stopped" in said, said
        assert not pid_alive(out.current.pid)
        assert [g.status for g in Store().serving_generations()] == ["retired", "retired"]
    finally:
        bluegreen.stop_active(state_path)
    assert not pid_alive(out.current.pid)
    shown = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)["serving"]
    assert shown["generation"] == 2 and shown["live"] is False  # stopped: the state file says so


def test_serve_with_both_ports_taken_and_nothing_serving_names_them(prefect_harness, home: Path) -> None:
    from flows.stages import ServeParams, serve

    q8, _ = tiny_ggufs()
    sockets = []
    try:
        for _ in range(2):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            sockets.append(sock)
        ports = tuple(s.getsockname()[1] for s in sockets)
        with pytest.raises(InputError, match=rf"ports \[{ports[0]}, {ports[1]}\].*in use"):
            serve(ServeParams(gguf_path=q8, ports=ports, hf_dir=q8.parent / "hf"))
    finally:
        for sock in sockets:
            sock.close()
    assert not (home / "serving" / "state.json").exists() and Store().serving_generations() == []


def test_generation_numbers_never_repeat_across_state_files(prefect_harness, home: Path, tmp_path: Path) -> None:
    """Regression: the demo's and the serve flow's state files each counted from 1, so the serve
    flow's generation N overwrote the demo's row N in the store (key: the generation alone). A
    rolled-back swap is recorded too (status ``rolled_back``), under a number of its own."""
    from deployments.cli import app
    from flows.stages import ServeParams, serve
    from forgeflow.common.errors import GGUFError, SwapRolledBackError
    from tasks.serving import stage_server

    q8, f16 = tiny_ggufs()
    q8_sha, f16_sha = sha256_file(q8), sha256_file(f16)
    hf_dir = q8.parent / "hf"
    hf_sha = sha256_tree(hf_dir)
    store = Store()
    # the chain the package stage records: the serve flow finds the config to check against here
    store.record_model_artifact(ModelArtifactRecord(sha256=hf_sha, kind="base", path=str(hf_dir)))
    store.record_model_artifact(ModelArtifactRecord(sha256=f16_sha, kind="gguf", quantization="f16", path=str(f16),
                                                    parent_sha256=hf_sha))
    store.record_model_artifact(ModelArtifactRecord(sha256=q8_sha, kind="gguf", quantization="Q8_0", path=str(q8),
                                                    parent_sha256=f16_sha))
    demo_state, serve_state = home / "demo" / "serving" / "state.json", home / "serving" / "state.json"
    demo_ports, serve_ports = (free_port(), free_port()), (free_port(), free_port())
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(q8.read_bytes()[: q8.stat().st_size // 2])
    busy = socket.socket()
    try:
        demo = serve(ServeParams(gguf_path=q8, state_path=demo_state, ports=demo_ports))
        assert demo.current.generation == 1 and demo.current.active_port == demo_ports[0]
        # the serve flow's own state file is empty, but the store already records generation 1
        standalone = serve(ServeParams(gguf_path=f16, ports=serve_ports))
        assert standalone.current.generation == 2 and standalone.previous is None
        assert standalone.current.active_port == serve_ports[0]
        rows = store.serving_generations()

        # a GGUF that fails its check starts nothing and records nothing
        with pytest.raises(GGUFError, match=rf"{broken} is not a readable GGUF file"):
            serve(ServeParams(gguf_path=broken, ports=serve_ports, hf_dir=hf_dir))
        assert store.serving_generations() == rows

        # a swap whose new server cannot start (its port is taken) is rolled back, says what serves
        # on, and is recorded as rolled back under the next number; the state file keeps generation 2
        busy.bind(("127.0.0.1", serve_ports[1]))
        busy.listen()
        failed = serve(ServeParams(gguf_path=q8, ports=serve_ports), return_state=True)
        assert failed.is_failed()
        with pytest.raises(SwapRolledBackError, match=r"\(generation 2 keeps serving\)"):
            failed.result()
        assert [(g.generation, g.gguf_sha256, g.port, g.status, g.run_id) for g in store.serving_generations()][2:] \
            == [(3, q8_sha, serve_ports[1], "rolled_back", str(failed.state_details.flow_run_id))]
        assert bluegreen.read_state(serve_state).generation == 2 and pid_alive(bluegreen.read_state(serve_state).pid)
        # the lifecycle's stage task (its promote stage) records its rollbacks the same way (a GGUF no server loads)
        with pytest.raises(SwapRolledBackError, match=r"\(nothing was serving\)"):
            stage_server.fn(tmp_path / "fresh" / "state.json", broken, sha256_file(broken),
                            BackendConfig(ports=(free_port(), free_port())))
        assert [(g.generation, g.gguf_sha256, g.status) for g in store.serving_generations()][3:] == [
            (4, sha256_file(broken), "rolled_back")]
        assert not (tmp_path / "fresh" / "state.json").exists()

        # the demo's next swap is numbered above every recorded number
        again = serve(ServeParams(gguf_path=f16, state_path=demo_state, ports=demo_ports))
        assert again.current.generation == 5 and again.previous.generation == 1
        assert [(g.generation, g.gguf_sha256, g.status) for g in store.serving_generations()] == [
            (1, q8_sha, "retired"), (2, f16_sha, "active"), (3, q8_sha, "rolled_back"),
            (4, sha256_file(broken), "rolled_back"), (5, f16_sha, "active")]

        result = CliRunner().invoke(app, ["lineage", q8_sha, "--json", "--no-verify"])
        assert result.exit_code == 0, result.output
        assert [(g["generation"], g["port"], g["status"]) for g in json.loads(result.output)["serving_generations"]] \
            == [(1, demo_ports[0], "retired"), (3, serve_ports[1], "rolled_back")]
        result = CliRunner().invoke(app, ["lineage", f16_sha, "--json", "--no-verify"])
        assert [(g["generation"], g["port"]) for g in json.loads(result.output)["serving_generations"]] == [
            (2, serve_ports[0]), (5, demo_ports[1])]
        shown = json.loads(CliRunner().invoke(app, ["status", "--json"]).output)["serving"]
        assert shown == {"generation": 5, "port": demo_ports[1], "gguf_sha256": f16_sha, "status": "active",
                         "live": True, "state_path": str(demo_state)}
    finally:
        busy.close()
        bluegreen.stop_active(demo_state)
        bluegreen.stop_active(serve_state)


def test_serve_checks_the_gguf_against_its_config_before_starting_a_server(prefect_harness, home: Path,
                                                                            tmp_path: Path) -> None:
    from flows.stages import ServeParams, serve
    from forgeflow.common.errors import GGUFError

    q8, _ = tiny_ggufs()
    config = json.loads((q8.parent / "hf" / "config.json").read_text())
    wrong = tmp_path / "wrong-config"  # a checkpoint whose config says 3 layers; the GGUF has 2
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    ports = (free_port(), free_port())
    state_path = home / "serving" / "state.json"

    def nothing_started() -> None:
        assert not state_path.exists() and Store().serving_generations() == []
        for port in ports:
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"something listens on {port}"

    with pytest.raises(GGUFError) as refused:
        serve(ServeParams(gguf_path=q8, ports=ports, hf_dir=wrong))
    message = str(refused.value)
    assert str(q8) in message and "'qwen2.block_count' expected 3" in message and "found 2" in message
    nothing_started()
    # no hf_dir and a GGUF the store does not know: refused, naming what to give
    with pytest.raises(InputError, match=r"cannot be checked against its HF config.*give params\.hf_dir"):
        serve(ServeParams(gguf_path=q8, ports=ports))
    nothing_started()
    # the config comes from the chain the store records (here: the wrong checkpoint) when hf_dir is left out
    store = Store()
    store.record_model_artifact(ModelArtifactRecord(sha256=sha256_tree(wrong), kind="base", path=str(wrong)))
    store.record_model_artifact(ModelArtifactRecord(sha256=sha256_file(q8), kind="gguf", quantization="Q8_0",
                                                    path=str(q8), parent_sha256=sha256_tree(wrong)))
    with pytest.raises(GGUFError, match=rf"'qwen2.block_count' expected 3 \(from {wrong / 'config.json'}\)"):
        serve(ServeParams(gguf_path=q8, ports=ports))
    nothing_started()


def _merged_copy(hf_dir: Path, dest: Path) -> Path:
    """A checkpoint folder with the tiny model's config but other bytes (as a LoRA merge leaves it)."""
    shutil.copytree(hf_dir, dest)
    (dest / "merge-note.txt").write_text("merged with an adapter\n")
    return dest


def _release_inputs(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """(tiny Q8_0, tiny f16, the HF checkpoint they came from, a copy of the Q8_0 to publish)."""
    q8, f16 = tiny_ggufs()
    gguf = tmp_path / "release" / "tiny-Q8_0.gguf"
    gguf.parent.mkdir()
    shutil.copyfile(q8, gguf)
    return q8, f16, q8.parent / "hf", gguf


def test_publish_refuses_a_checkpoint_the_store_did_not_convert_the_gguf_from(prefect_harness, home: Path,
                                                                              tmp_path: Path) -> None:
    from blocks.core import ModelStore
    from flows.stages import PublishParams, publish

    q8, f16, hf_dir, gguf = _release_inputs(tmp_path)
    merged = _merged_copy(hf_dir, tmp_path / "merged")
    base_sha, merged_sha, adapter_sha = sha256_tree(hf_dir), sha256_tree(merged), "a" * 64
    store = Store()
    for record in (ModelArtifactRecord(sha256=base_sha, kind="base", path=str(hf_dir)),
                   ModelArtifactRecord(sha256=adapter_sha, kind="adapter", path="/gone", parent_sha256=base_sha),
                   ModelArtifactRecord(sha256=merged_sha, kind="merged", path=str(merged), parent_sha256=adapter_sha),
                   ModelArtifactRecord(sha256=sha256_file(f16), kind="gguf", quantization="f16", path=str(f16),
                                       parent_sha256=merged_sha),
                   ModelArtifactRecord(sha256=sha256_file(q8), kind="gguf", quantization="Q8_0", path=str(q8),
                                       parent_sha256=sha256_file(f16))):
        store.record_model_artifact(record)
    models = tmp_path / "models"
    ModelStore(path=models).save("test-ledger-store", overwrite=True)

    # the store says: converted from the merged checkpoint (base + adapter); the base is refused
    with pytest.raises(InputError) as refused:
        publish(PublishParams(gguf_path=gguf, store="test-ledger-store", hf_dir=hf_dir, model_name="tiny"))
    message = str(refused.value)
    assert str(hf_dir) in message and base_sha in message and merged_sha in message and adapter_sha in message
    # the merged checkpoint without the adapter the chain has is refused too
    with pytest.raises(InputError, match="adapter_dir none"):
        publish(PublishParams(gguf_path=gguf, store="test-ledger-store", hf_dir=merged, model_name="tiny"))
    assert not models.exists() and not (gguf.parent / "tiny-Q8_0.lineage.json").exists()  # nothing published


def test_publish_of_the_recorded_pair_works_and_a_wrong_hf_dir_is_refused(prefect_harness, home: Path,
                                                                          tmp_path: Path) -> None:
    from blocks.core import ModelStore
    from flows.stages import PublishParams, publish

    q8, f16, hf_dir, gguf = _release_inputs(tmp_path)
    store = Store()
    base_sha = sha256_tree(hf_dir)
    store.record_model_artifact(ModelArtifactRecord(sha256=base_sha, kind="base", path=str(hf_dir)))
    store.record_model_artifact(ModelArtifactRecord(sha256=sha256_file(f16), kind="gguf", quantization="f16",
                                                    path=str(f16), parent_sha256=base_sha))
    store.record_model_artifact(ModelArtifactRecord(sha256=sha256_file(q8), kind="gguf", quantization="Q8_0",
                                                    path=str(q8), parent_sha256=sha256_file(f16)))
    models = tmp_path / "models"
    ModelStore(path=models).save("test-ledger-store-2", overwrite=True)

    other = _merged_copy(hf_dir, tmp_path / "other")
    with pytest.raises(InputError, match=f"hf_dir {other}"):
        publish(PublishParams(gguf_path=gguf, store="test-ledger-store-2", hf_dir=other, model_name="tiny"))
    assert not models.exists()

    record = publish(PublishParams(gguf_path=gguf, store="test-ledger-store-2", hf_dir=hf_dir, model_name="tiny"))
    lineage = json.loads((Path(record.location) / "tiny-Q8_0.lineage.json").read_text())
    assert lineage["hf_sha256"] == base_sha and lineage["adapter_sha256"] is None


def test_package_records_its_artifacts_with_its_run_as_producer(plan_run: PlanRun) -> None:
    from forgeflow.packaging.lineage import lineage_of

    artifacts = plan_run.artifacts
    store = Store(plan_run.store_url)
    try:
        for key in (MIXED_PLAN, TEAM_SPEC["name"]):
            report = lineage_of(store, artifacts[key].sha256)
            assert [(s.kind, s.quantization, s.sha256) for s in report.chain] == [
                ("base", None, sha256_tree(plan_run.hf_dir)), ("gguf", "f16", artifacts["f16"].sha256),
                ("gguf", key, artifacts[key].sha256)]
            assert all(step.run_ids == [plan_run.run_id] for step in report.chain[1:])
            assert all(step.path_status == "ok" for step in report.chain)
    finally:
        store.dispose()


def test_package_takes_a_quantization_plan_with_mixed_per_tensor_types(prefect_harness, plan_run: PlanRun,
                                                                       home: Path, tmp_path: Path) -> None:
    """The hand-run pipeline's served mix by name, and a team's own spec (``plan_run``'s package run): every
    tensor a pattern names carries that type in the file, the rest the preset's, and the ledger keeps each key."""
    from flows.stages import PackageParams
    from forgeflow.packaging.gguf import MIXED_ATTN_EMBD_OUTPUT_Q8_0
    from tests.helpers import tensor_types_of

    hf_dir = plan_run.hf_dir
    with pytest.raises(ValidationError, match=r"quantizations\n  Value error, quantization 'Q3_K' is not a named plan"):
        PackageParams(hf_dir=hf_dir, out_dir=tmp_path / "refused", quantizations=("Q3_K",))

    artifacts = plan_run.artifacts
    assert set(artifacts) == {"f16", "Q4_K_M+attn-embd-output-Q8_0", "q8-ffn-f16"}
    mixed = artifacts["Q4_K_M+attn-embd-output-Q8_0"]
    assert mixed.type == "Q4_K_M+mixed" and mixed.tensor_types == MIXED_ATTN_EMBD_OUTPUT_Q8_0
    types = tensor_types_of(mixed.path)
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ffn_up.weight"] != "F16"  # the preset's (or llama.cpp's fallback for its row size)
    own = tensor_types_of(artifacts["q8-ffn-f16"].path)
    assert own["blk.0.ffn_up.weight"] == "F16" and own["blk.0.attn_q.weight"] == "Q8_0"
    store = Store(plan_run.store_url)
    try:
        recorded = {a.quantization for a in store.model_artifacts() if a.kind == "gguf"}
    finally:
        store.dispose()
    assert {"Q4_K_M+attn-embd-output-Q8_0", "q8-ffn-f16"} <= recorded


def test_package_applies_metadata_edits_and_records_the_edited_files(prefect_harness, home: Path,
                                                                      tmp_path: Path) -> None:
    """The hand-run pipeline's metadata fixes as typed edits: a new chat template and name, an added
    key, a stale key removed, on every GGUF (one edit on the Q8_0 only); the GGUF check and the load
    pass on the edited files, their tensors are the unedited tiny model's, and the store records
    the edited files' sha256 with the edits in their lineage; publish accepts the edited Q8_0."""
    from blocks.core import ModelStore
    from flows.stages import PackageParams, PublishParams, package, publish
    from forgeflow.packaging.gguf_reader import read_header_index, read_metadata, tensor_sha256

    q8_unedited, f16_unedited = tiny_ggufs()
    hf_dir = q8_unedited.parent / "hf"
    with pytest.raises(ValidationError, match=r"metadata_edits\n  Value error, metadata_edits\[0\] \(key 'general.name'\): "
                                              r"op 'patch' is not one of"):
        PackageParams(hf_dir=hf_dir, out_dir=tmp_path / "refused", quantizations=("Q8_0",),
                      metadata_edits=[{"op": "patch", "key": "general.name"}])

    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    edits = [
        {"op": "set", "key": "tokenizer.chat_template", "value": template},
        {"op": "set", "key": "general.name", "value": "forgeflow-agent-v3"},
        {"op": "add", "key": "forgeflow.release", "value": 7, "type": "UINT32"},
        {"op": "delete", "key": "general.size_label"},
        {"op": "add", "key": "forgeflow.quantized_only", "value": True, "artifacts": ["Q8_0"]},
    ]
    artifacts = package(PackageParams(hf_dir=hf_dir, out_dir=tmp_path / "out", quantizations=("Q8_0",), metadata_edits=edits)).artifacts
    recorded = {a.quantization: a for a in Store().model_artifacts() if a.kind == "gguf"}
    for key, unedited in (("Q8_0", q8_unedited), ("f16", f16_unedited)):
        art = artifacts[key]
        # read back from the header alone (tests/core/packaging/test_gguf_edit.py holds this reader to gguf-py's
        # GGUFReader, which takes 10-30 s per file here: it materializes the 151,936-token vocabulary)
        index = read_header_index(art.path)
        assert read_metadata(art.path, "tokenizer.chat_template", index) == template
        assert read_metadata(art.path, "general.name", index) == "forgeflow-agent-v3"
        release = index.fields["forgeflow.release"]
        assert release.value_type == "UINT32" and read_metadata(art.path, "forgeflow.release", index) == 7
        assert "general.size_label" not in index.fields
        assert ("forgeflow.quantized_only" in index.fields) == (key == "Q8_0")
        assert read_metadata(art.path, "general.architecture", index) == "qwen2"
        assert tensor_sha256(art.path, index) == tensor_sha256(unedited)  # the same tensors, byte for byte
        assert art.sha256 == sha256_file(art.path) != sha256_file(unedited)
        row = recorded[key]
        assert (row.sha256, row.path) == (art.sha256, str(art.path))
        assert [(e["op"], e["key"]) for e in row.lineage["metadata_edits"]] == [
            (e["op"], e["key"]) for e in edits if key in e.get("artifacts", [key])]
        assert row.lineage["edited_from_sha256"] not in (None, art.sha256)
    assert recorded["Q8_0"].parent_sha256 == artifacts["f16"].sha256

    # publish checks the edited GGUF against its checkpoint again: the patched chat template is what
    # the recorded edit set, not the checkpoint's, and is accepted
    ModelStore(path=tmp_path / "models").save("test-ledger-store-edits", overwrite=True)
    record = publish(PublishParams(gguf_path=artifacts["Q8_0"].path, store="test-ledger-store-edits", hf_dir=hf_dir, model_name="edited"))
    assert [f.sha256 for f in record.files if f.role == "gguf"] == [artifacts["Q8_0"].sha256]
