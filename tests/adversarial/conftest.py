"""Fixtures of the adversarial corpus: the calc task image, built once per session (and kept by podman
between sessions under its tag)."""

from __future__ import annotations

import pytest

from tests.adversarial.calc_task import BUGGY_CALC, CONFTEST, ENV_TEST, TASK_IMAGE, TESTS, build_task_image


@pytest.fixture(scope="session")
def task_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_task_image(tmp_path_factory.mktemp("calc"), TASK_IMAGE, {
        "calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS, "tests/test_env.py": ENV_TEST, "conftest.py": CONFTEST})
