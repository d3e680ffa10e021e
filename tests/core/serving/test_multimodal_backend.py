"""The serving backend's multimodal options and the ``tiny-vl`` base model choice, as a user writes them."""

from __future__ import annotations

import pytest

from forgeflow.common.errors import InputError
from forgeflow.packaging.checkpoint import BaseModelSource
from forgeflow.serving.backend import BackendConfig, backend_config


def test_multimodal_options_reach_llama_server_only_and_are_validated(tmp_path) -> None:
    mm = tmp_path / "mmproj.gguf"
    config = backend_config({"kind": "llama-server", "mmproj": str(mm), "image_min_tokens": 1024,
                             "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"})
    assert (config.mmproj, config.image_min_tokens, config.cache_type_k, config.cache_type_v,
            config.flash_attn) == (mm, 1024, "q8_0", "q8_0", "on")
    assert f"--mmproj {mm}" in config.describe() and "-fa on" in config.describe()
    refused = {
        "flash_attn must be one of on, off, auto": {"kind": "llama-server", "flash_attn": "yes"},
        "cache_type_v must be one of": {"kind": "llama-server", "cache_type_v": "q3_k"},
        "mmproj need kind 'llama-server'": {"mmproj": str(mm)},
        "cannot be set with kind 'external'": {"kind": "external", "base_url": "http://10.0.0.5:8000/v1",
                                               "mmproj": str(mm)},
    }
    for message, fields in refused.items():
        with pytest.raises(InputError, match=message):
            backend_config(fields)
    # a lifecycle's block carries the image budget before the package stage hands the serve stage its projector;
    # a server started without one refuses it before anything runs
    budget_only = backend_config({"kind": "llama-server", "image_min_tokens": 1024})
    from forgeflow.serving.backend import LlamaServer

    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # checked for existence (and the port for range) first
    with pytest.raises(InputError, match="image_min_tokens needs mmproj"):
        LlamaServer(tmp_path / "model.gguf", 8999, budget_only)
    from blocks.core import ServingBackend

    assert set(BackendConfig.model_fields) <= set(ServingBackend.model_fields)  # the block carries every option


def test_base_model_tiny_vl_is_a_named_choice() -> None:
    assert BaseModelSource.model_validate("tiny-vl").kind == "tiny-vl"
    assert BaseModelSource.model_validate("tiny").kind == BaseModelSource().kind == "tiny"
    assert BaseModelSource.model_validate({"tiny_vl": True}).kind == "tiny-vl"
    for bad in ("tiny-xl", {"tiny_vl": True, "local_dir": "/models/x"}):
        with pytest.raises(ValueError, match="base model"):
            BaseModelSource.model_validate(bad)
