"""Harbor environment for forgeflow's tasks on a local, offline podman.

Use it with ``-e forgeflow_harbor_env:ForgeflowPodmanEnvironment``.

Loaded by Harbor (0.25, Python >= 3.12, in its own virtualenv; see ``scripts/harbor_venv.sh``)
from this folder on ``PYTHONPATH``. It imports only harbor and the standard library: forgeflow
itself is not installed in Harbor's virtualenv.

Why a subclass of Harbor's :class:`~harbor.environments.podman.PodmanEnvironment`:

* Harbor's docker/podman environment can cut the network only through its egress-control
  sidecar, and enables that sidecar only after a kernel probe that runs
  ``alpine:3.23.4`` pulled from Docker Hub. Offline the pull fails, the environment then reports
  ``disable_internet=False`` and Harbor refuses every ``network_mode = "no-network"`` task.
  forgeflow's tasks need no network at all (not an allowlist), so this class skips the probe,
  declares ``disable_internet``, and adds Harbor's own no-network compose override
  (``docker-compose-no-network.yaml``: ``network_mode: none`` on the ``main`` service), which
  is what Harbor's other compose-based providers use for the same mode.
* ``init: true`` and a 2 s ``stop_grace_period`` (``forgeflow-stop.yaml`` beside this file):
  the ``sleep infinity`` keepalive as PID 1 ignores SIGTERM, so without an init every trial's
  stop waits out the grace period (10-15 s measured on this kind of machine).
* Uploads (tests, solution, agent logs) go straight to Harbor's own tar-stream upload when the
  compose frontend has no ``cp`` (podman-compose 1.x): Harbor would first run a ``cp`` that is
  bound to fail, one extra podman-compose process per upload.

Requirements on the host: podman, and podman-compose >= 1.1 (Debian's 1.0.3 lacks ``--in-pod``)
first on ``PATH``; ``CONTAINERS_CONF`` pointing at forgeflow's ``infra/containers.conf`` (runc,
lowered ulimits) where the default runtime does not work.
"""

from __future__ import annotations

from pathlib import Path

from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.docker import COMPOSE_NO_NETWORK_PATH
from harbor.environments.podman import PodmanEnvironment

STOP_OVERRIDE_PATH = Path(__file__).resolve().parent / "forgeflow-stop.yaml"
"""Compose override: ``init: true`` and ``stop_grace_period: 2s`` on the ``main`` service."""


class ForgeflowPodmanEnvironment(PodmanEnvironment):
    """Harbor's podman environment that can run ``no-network`` tasks offline.

    Network: when the trial's network policy is ``no-network`` the ``main`` container runs with
    ``network_mode: none`` (Harbor's override file); public tasks are unchanged. Allowlists are
    not supported (no egress sidecar): Harbor's own validation refuses them.
    """

    @classmethod
    def _egress_control_kernel_support(cls) -> bool:
        """No egress-control sidecar: its kernel probe pulls an image from Docker Hub."""
        return False

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """The podman capabilities plus ``disable_internet`` (enforced by ``network_mode: none``)."""
        return super().capabilities.model_copy(update={"disable_internet": True})

    @property
    def _docker_compose_paths(self) -> list[Path]:
        """Harbor's compose files, then the no-network override (if the network is cut) and
        forgeflow's init/stop-grace override."""
        paths = list(super()._docker_compose_paths)
        if self._network_disabled:
            paths.append(COMPOSE_NO_NETWORK_PATH)
        paths.append(STOP_OVERRIDE_PATH)
        return paths

    def _tar_uploads(self) -> bool:
        return not type(self).runtime().supports_compose_cp and not self._is_windows_container

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Harbor's upload, skipping the ``compose cp`` attempt its frontend cannot do."""
        if self._tar_uploads():
            await self._platform._upload_file_with_tar(source_path, target_path)
        else:
            await super().upload_file(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Harbor's upload, skipping the ``compose cp`` attempt its frontend cannot do."""
        if self._tar_uploads():
            await self._platform._upload_dir_with_tar(source_dir, target_dir)
        else:
            await super().upload_dir(source_dir, target_dir)
