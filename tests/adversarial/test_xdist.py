"""A test command under pytest-xdist (``-n``): the tests run in worker processes the verifier's report
plugin does not report from, so the channel cannot grade them. A pristine run (validation: the task's
own command) is refused with a clear error naming ``-n``, never read as tampering or as a wrong answer;
a scored run that became distributed (the validated command is not) is tampering.

The task image is the corpus' calc task with the host's pytest-xdist and execnet (pure Python, the test
extras' pins) copied into its interpreter's packages, real xdist workers in podman.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

from forgeflow.common import errors
from forgeflow.common.settings import tool_env
from forgeflow.registry.images import image_exists
from forgeflow.sandbox.podman import PodmanSandbox
from forgeflow.sandbox.verifier import run_tests
from tests.adversarial.calc_task import F2P, SPEC, TEST_COMMAND, calc_task

pytestmark = pytest.mark.integration

XDIST_IMAGE = "localhost/forgeflow/test-verifier-xdist:1"


@pytest.fixture(scope="module")
def xdist_image(task_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    if image_exists(XDIST_IMAGE):
        return XDIST_IMAGE
    ctx = tmp_path_factory.mktemp("xdist")
    for dist_name, packages in (("pytest-xdist", ("xdist",)), ("execnet", ("execnet",))):
        dist = importlib.metadata.distribution(dist_name)
        root = Path(dist.locate_file(""))
        for name in (*packages, Path(dist._path).name):  # the package and its dist-info (entry points)
            shutil.copytree(root / name, ctx / "site" / name, ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Containerfile").write_text(f"FROM {task_image}\nCOPY site /usr/lib/python3/dist-packages/\n")
    subprocess.run(["podman", "build", "-q", "-t", XDIST_IMAGE, "-f", str(ctx / "Containerfile"), str(ctx)],
                   env=tool_env(), check=True, capture_output=True, text=True, timeout=600)
    return XDIST_IMAGE


def test_a_distributed_run_is_refused_in_validation_and_tampering_when_scored(xdist_image: str) -> None:
    with PodmanSandbox(xdist_image, SPEC, "ff-test-adv-xdist") as sandbox:
        plain = run_tests(sandbox, TEST_COMMAND, 60)  # xdist installed but not asked for: graded as ever
        assert plain.tests[F2P[0]] == "FAILED" and not plain.tampering
        command = TEST_COMMAND.replace("pytest ", "pytest -n 2 ", 1)
        with pytest.raises(errors.VerifierOutputError, match=r"pytest-xdist \(load with 2 workers\).*drop -n"):
            run_tests(sandbox, command, 60)
        scored = run_tests(sandbox, command, 60, expect=calc_task(xdist_image, command))
        assert any("distributed by pytest-xdist" in t for t in scored.tampering), scored.tampering
