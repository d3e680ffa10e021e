"""The serving backend configuration (forgeflow/serving/backend.py) and the ``forgeflow-serving``
block: what a user sets is what the server is started with, a setting the chosen server cannot
honour is refused by name, and a slot plan too small for a request is refused before any start
(pure logic; the servers themselves run in tests/flows/test_serve_backend.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks.core import ServingBackend
from forgeflow.common.errors import InputError
from forgeflow.serving.backend import BackendConfig, LlamaServer, backend_config
from forgeflow.serving.llama_server import ContextPreflightError
from forgeflow.serving.server import ModelServer
from tests.helpers import tiny_ggufs


def test_the_default_is_llama_cpp_python_on_8801_8802_with_4096_tokens() -> None:
    config = BackendConfig()
    assert (config.kind, config.ports, config.n_ctx, config.model_alias) == (
        "llama-cpp-python", (8801, 8802), 4096, "forgeflow")
    assert config.preflight().per_slot == 4096


@pytest.mark.parametrize(("fields", "message"), [
    ({"ports": (8801, 8801)}, "two distinct ports"),
    ({"ports": (80, 8802)}, "outside 1024..65535"),
    ({"n_ctx": 8}, "n_ctx"),
    ({"kind": "vllm"}, "kind"),
    ({"n_parallel": 0}, "n_parallel"),
    ({"kind": "llama-server", "cache_type": "q3_k"}, "cache_type must be one of f32, f16"),
    ({"n_parallel": 4}, "n_parallel need kind 'llama-server'"),
    ({"n_gpu_layers": 99, "cache_type": "q8_0"}, "n_gpu_layers, cache_type need kind 'llama-server'"),
    ({"model_alias": "two words"}, "model_alias"),
    ({"ctx": 4096}, "ctx"),  # a misspelt field is refused, not ignored
])
def test_bad_settings_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BackendConfig(**fields)
    with pytest.raises(InputError, match=f"my-block is not a valid serving backend: .*{message}"):
        backend_config(fields, "my-block")


def test_llama_server_options_reach_the_command_line(tmp_path: Path) -> None:
    q8 = tiny_ggufs()[0]
    config = BackendConfig(kind="llama-server", ports=(9101, 9102), n_ctx=8192, n_parallel=4, kv_unified=True,
                           cache_type="q8_0", n_gpu_layers=0, required_context_tokens=6000, n_threads=3,
                           model_alias="coder", binary=Path("/opt/llama/bin/llama-server"))
    server = config.server(q8, 9102, tmp_path / "s.log")
    assert isinstance(server, LlamaServer)
    argv = server.argv()
    pairs = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert argv[0] == "/opt/llama/bin/llama-server"
    assert {k: pairs[k] for k in ("--port", "--alias", "--ctx-size", "--parallel", "--threads",
                                  "--cache-type-k", "--cache-type-v")} == {
        "--port": "9102", "--alias": "coder", "--ctx-size": "8192", "--parallel": "4", "--threads": "3",
        "--cache-type-k": "q8_0", "--cache-type-v": "q8_0"}
    assert "--kv-unified" in argv
    assert server.plan.per_slot == 8192 and server.log_path == tmp_path / "s.log"


def test_llama_cpp_python_gets_the_alias_context_and_threads(tmp_path: Path) -> None:
    q8 = tiny_ggufs()[0]
    server = BackendConfig(n_ctx=2048, n_threads=2, model_alias="tiny").server(q8, 9201, tmp_path / "s.log")
    assert type(server) is ModelServer
    argv = server.argv()
    assert argv[argv.index("--n_ctx") + 1] == "2048" and argv[argv.index("--model_alias") + 1] == "tiny"
    assert argv[argv.index("--n_threads") + 1] == "2"


def test_a_request_larger_than_a_slot_is_refused_before_a_start_with_the_fixes() -> None:
    split = BackendConfig(kind="llama-server", n_ctx=16384, n_parallel=4, required_context_tokens=6000)
    with pytest.raises(ContextPreflightError, match="needs 6000 tokens .* each slot holds 4096 .*raise -c to at "
                                                    "least 24000, or lower -np, or use --kv-unified"):
        split.preflight()
    unified = split.model_copy(update={"kv_unified": True})
    assert unified.preflight().per_slot == 16384
    # the GGUF's training context caps every slot: no server setting fixes a model trained for 4096
    with pytest.raises(ContextPreflightError, match="trained for 4096"):
        unified.preflight(n_ctx_train=4096)
    small = BackendConfig(n_ctx=2048, required_context_tokens=3000)
    with pytest.raises(ContextPreflightError, match="one slot holds 2048; raise n_ctx"):
        small.preflight()
    with pytest.raises(ContextPreflightError, match=r"holds 1024 \(the model was trained for 1024\)"):
        BackendConfig(n_ctx=4096, required_context_tokens=2000).preflight(n_ctx_train=1024)


def test_the_block_fields_become_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    block = ServingBackend(kind="llama-server", ports=(9301, 9302), n_ctx=4096, n_parallel=2,
                           required_context_tokens=1000, n_gpu_layers=33)
    config = block.config()
    assert (config.kind, config.ports, config.n_parallel, config.n_gpu_layers, config.required_context_tokens) == (
        "llama-server", (9301, 9302), 2, 33, 1000)
    assert "-np 2" in config.describe() and "-ngl 33" in config.describe()
    with pytest.raises(ValidationError, match="n_parallel need kind 'llama-server'"):
        ServingBackend(n_parallel=2)  # refused where the block is made, before it is saved


def test_the_block_is_the_backend_config_with_its_bounds_in_the_ui_form() -> None:
    """The ``forgeflow-serving`` block is BackendConfig itself (one declaration of each field): the form the UI
    draws from its schema carries BackendConfig's kinds and bounds."""
    assert issubclass(ServingBackend, BackendConfig) and set(ServingBackend.model_fields) == set(
        BackendConfig.model_fields)
    schema = ServingBackend.model_json_schema()
    assert schema["properties"]["kind"]["enum"] == ["llama-cpp-python", "llama-server", "external"]
    assert schema["properties"]["n_ctx"]["minimum"] == 16 and schema["properties"]["n_gpu_layers"]["minimum"] == 0
    assert type(ServingBackend(kind="llama-server", n_parallel=2).config()) is BackendConfig  # what tasks cache on


@pytest.mark.parametrize(("fields", "message"), [
    ({"n_parallel": 2}, "n_parallel cannot be set with kind 'external'"),
    ({"cache_type": "q8_0", "n_gpu_layers": 99}, "cache_type, n_gpu_layers cannot be set with kind 'external'"),
    ({"binary": "/opt/llama/bin/llama-server"}, "binary cannot be set with kind 'external'"),
    ({"host": "0.0.0.0", "ports": (9001, 9002)}, "ports, host cannot be set with kind 'external'"),  # noqa: S104
    ({"n_ctx": 8192, "n_threads": 4}, "n_ctx, n_threads cannot be set with kind 'external'"),
    ({"base_url": None}, "kind 'external' needs base_url"),
    ({"base_url": "10.0.0.5:8000/v1"}, "must be an http:// or https:// URL with a host"),
    ({"base_url": "http://user:pw@10.0.0.5/v1"}, "no query, fragment or credentials"),
])
def test_the_block_refuses_a_started_servers_fields_for_an_external_endpoint(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServingBackend(**{"kind": "external", "base_url": "http://10.0.0.5:8000/v1", **fields})


def test_an_external_endpoint_keeps_its_url_alias_and_key_name_and_other_kinds_refuse_them() -> None:
    config = ServingBackend(kind="external", base_url="https://api.example.com/v1/", model_alias="coder-v3",
                            api_key_secret="endpoint-key", required_context_tokens=6000).config()
    assert (config.base_url, config.external_port, config.model_alias, config.api_key_secret) == (
        "https://api.example.com/v1", 443, "coder-v3", "endpoint-key")
    assert config.preflight(n_ctx_train=32768) is None  # no slot plan: /props is read once it answers
    with pytest.raises(ContextPreflightError, match="needs 6000 tokens .* trained for 4096"):
        config.preflight(n_ctx_train=4096)
    with pytest.raises(InputError, match="is not started by forgeflow"):
        config.server(tiny_ggufs()[0], 8801, Path("unused.log"))
    for kind in ("llama-cpp-python", "llama-server"):
        with pytest.raises(ValidationError, match="base_url, api_key_secret need kind 'external'"):
            ServingBackend(kind=kind, base_url="http://10.0.0.5:8000/v1", api_key_secret="k")
