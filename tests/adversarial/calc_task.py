"""The shared task of the adversarial corpus: a small ``calc`` project in a real task image under podman.

The task image is built FROM the Debian base image (python 3.11, pytest 7.2): ``add`` is broken
(FAIL_TO_PASS ``test_add``), ``mul`` works, and the task's own ``conftest.py`` writes bytes that are
not UTF-8 to the terminal outside pytest's capture. Every module of ``tests/adversarial`` attacks
this task (or one built the same way with :func:`build_task_image`): a submission that does not fix
``add`` must get reward 0 (or a named tampering record), never 1.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from forgeflow.common import errors
from forgeflow.common.settings import tool_env
from forgeflow.registry.images import BASE_IMAGE_TAG, ensure_base_image, image_exists
from forgeflow.sandbox.base import SandboxSpec
from forgeflow.sandbox.scoring import verify_submission
from forgeflow.sandbox.verifier import TaskTests

TASK_IMAGE = "localhost/forgeflow/test-verifier-calc:2"
FLAKY_IMAGE = "localhost/forgeflow/test-verifier-flaky:1"
TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider tests"
F2P = ["tests/test_calc.py::test_add"]
IDS = ["tests/test_calc.py::test_ids[a b]", "tests/test_calc.py::test_ids[c::d]", "tests/test_calc.py::test_ids[[x]]"]
P2P = ["tests/test_calc.py::test_mul", "tests/test_env.py::test_pinned_environment", *IDS]
SPEC = SandboxSpec(memory_mb=256)

GOOD_CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
BUGGY_CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = textwrap.dedent('''\
    import pytest
    from calc import add, mul


    def test_add():
        assert add(2, 3) == 5


    def test_mul():
        assert mul(2, 3) == 6


    @pytest.mark.parametrize("x", ["a b", "c::d", "[x]"])
    def test_ids(x):
        assert mul(1, 1) == 1
''')
ENV_TEST = textwrap.dedent('''\
    import os


    def test_pinned_environment():
        assert os.environ["TZ"] == "UTC" and os.environ["PYTHONHASHSEED"] == "0"
        assert os.environ["LC_ALL"] == "C.UTF-8" and os.environ["PYTHONNOUSERSITE"] == "1"
''')
CONFTEST = ('import atexit\nimport os\n\n# after pytest, outside its capture: bytes that are not UTF-8 on both streams\n'
            'atexit.register(os.write, 1, b"\\xff\\xfe not UTF-8 \\xe9t\\xe9\\n")\n'
            'atexit.register(os.write, 2, b"\\x80\\x81\\n")\n')
CONTAINERFILE = f"""\
FROM {BASE_IMAGE_TAG}
COPY testbed /testbed
WORKDIR /testbed
ENV PYTHONPATH=/testbed
RUN git init -q && git add -A \\
 && git -c user.name=forgeflow -c user.email=forgeflow@localhost commit -qm task
"""


def build_task_image(tmp: Path, tag: str, files: dict[str, str]) -> str:
    if image_exists(tag):
        return tag
    ensure_base_image()
    for rel, text in files.items():
        (tmp / "testbed" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "testbed" / rel).write_text(text)
    (tmp / "Containerfile").write_text(CONTAINERFILE)
    subprocess.run(["podman", "build", "-q", "-t", tag, "-f", str(tmp / "Containerfile"), str(tmp)],
                   env=tool_env(), check=True, capture_output=True, text=True, timeout=600)
    return tag


def make_patch(path: str, old: str | None, new: str | None) -> str:
    """A git-style unified diff of one file (created when ``old`` is None, deleted when ``new`` is)."""
    old_lines, new_lines = (old or "").splitlines(), (new or "").splitlines()
    head = [f"diff --git a/{path} b/{path}"]
    if old is None:
        head += ["new file mode 100644", "--- /dev/null", f"+++ b/{path}"]
    elif new is None:
        head += ["deleted file mode 100644", f"--- a/{path}", "+++ /dev/null"]
    else:
        head += [f"--- a/{path}", f"+++ b/{path}"]
    hunk = [f"@@ -{1 if old_lines else 0},{len(old_lines)} +{1 if new_lines else 0},{len(new_lines)} @@"]
    return "\n".join(head + hunk + [f"-{x}" for x in old_lines] + [f"+{x}" for x in new_lines]) + "\n"


FIX = make_patch("calc.py", BUGGY_CALC, GOOD_CALC)


def calc_with(prefix: str) -> str:
    """The unfixed calc.py with ``prefix`` run at import (the code under test, as a submission changes it)."""
    return make_patch("calc.py", BUGGY_CALC, prefix + BUGGY_CALC)


def calc_task(image: str, command: str = TEST_COMMAND) -> TaskTests:
    """The calc task in ``image``, its tests run by ``command`` (no known tests recorded)."""
    return TaskTests(instance_id="calc-task", image_ref=image, test_command=command, FAIL_TO_PASS=F2P,
                     PASS_TO_PASS=P2P)


def verify(image: str, submission: str, name: str, **kwargs: object):
    """:func:`verify_submission` of ``submission`` on the calc task in ``image`` (container ``ff-test-adv-<name>``)."""
    return verify_submission(calc_task(image), submission, timeout_s=120, spec=SPEC, name=f"ff-test-adv-{name}",
                             **kwargs)


def failures(image: str, variants: dict[str, str], prefix: str = "variant", **kwargs: object) -> dict[str, str]:
    """Verify each variant (container ``ff-test-adv-<prefix>-<label>``); ``{label: why}`` for every one that was
    credited or raised an exception (a corpus test asserts this is empty)."""
    bad = {}
    for label, submission in variants.items():
        try:
            verdict = verify(image, submission, f"{prefix}-{label}", **kwargs)
        except errors.ForgeflowError as exc:
            bad[label] = f"raised {type(exc).__name__}: {str(exc)[:200]}"
            continue
        if verdict.reward != 0.0:
            bad[label] = f"reward {verdict.reward}: {verdict.notes}"
    return bad
