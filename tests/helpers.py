"""Small helpers shared by the tests: a free loopback port, a live-process check, the tiny GGUFs,
a one-layer OCI image on disk."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import tarfile
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state != "Z"


def tiny_ggufs() -> tuple[Path, Path]:
    """(Q8_0, f16) GGUFs of the seed-0 tiny model, built once per machine under the cache."""
    from forgeflow.common.fsutil import file_lock
    from forgeflow.common.settings import cache_dir
    from forgeflow.packaging.base_model import build_tiny_model
    from forgeflow.packaging.gguf import convert_to_gguf, quantize

    root = cache_dir() / "test-fixtures" / "tiny-seed0"
    f16, q8 = root / "tiny-f16.gguf", root / "tiny-q8_0.gguf"
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".build.lock"):  # xdist workers on a fresh machine: one builds, the others wait
        if not (f16.is_file() and q8.is_file()):
            record = build_tiny_model(root / "hf", seed=0)
            convert_to_gguf(record.path, f16, outtype="f16")
            quantize(f16, q8, "Q8_0")
    return q8, f16


def _oci_blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_image(root: Path, tag: str, payload: bytes) -> str:
    """An OCI layout with one uncompressed layer holding ``payload``; returns its oci: reference."""
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("payload.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer_desc = _oci_blob(root, layer.getvalue())
    config = {"architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}
    config_desc = _oci_blob(root, json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_desc}]}
    manifest_desc = _oci_blob(root, json.dumps(manifest).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest_desc,
         "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return f"oci:{root}:{tag}"


def task_status_counts(store) -> dict[str, int]:
    """Number of tasks per status in ``store`` (statuses with none are absent): what a test checks after a run."""
    from collections import Counter

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from forgeflow.ledger.tables import TaskInstance

    with Session(store.engine) as session:
        return dict(Counter(session.scalars(select(TaskInstance.status))))


def store_revision(store) -> str | None:
    """The Alembic revision ``store``'s database is at (None before its first upgrade)."""
    from forgeflow.ledger.migrating import stored_revision

    return stored_revision(store.engine)


def ensure_env_image(project):
    """Fetch, check out and build ``project``'s environment image (each step cached), as the environments stage does."""
    from forgeflow.common.settings import cache_dir
    from forgeflow.registry.images import build_env_image, ensure_base_image
    from forgeflow.registry.projects import prepare_checkout

    return build_env_image(project, prepare_checkout(project, cache_dir() / "checkouts"), ensure_base_image().name)


def tensor_types_of(path) -> dict[str, str]:
    """Tensor name -> ggml type name of a GGUF file, from its header (what a test of per-tensor quantization reads)."""
    from forgeflow.packaging.gguf_reader import read_header_index

    return {t.name: t.ggml_type for t in read_header_index(path).tensors}
