"""Attack class: a ``.gitattributes`` of the submission's changes how git reads the tree the verifier judges.

Found by a red-team run against this verifier (both gave reward 1.0 with the default policies before the
fix): ``working-tree-encoding=UTF-7`` made git hash an edited test file as its pristine bytes, so git's
list of changes missed the edit; ``-diff`` made a source edit a binary part of git's patch, which the
static screen skipped. The sandbox's ``.git/info/attributes`` now outranks every ``.gitattributes``
(:data:`forgeflow.sandbox.changes.NEUTRAL_ATTRIBUTES`) and ``.gitattributes`` is the task's own file. The
``drop`` policy is used below so that the path rule alone does not decide: the attribute file is put back,
and what git then sees must still score 0.
"""

from __future__ import annotations

import pytest

from tests.adversarial.calc_task import BUGGY_CALC, make_patch, verify
from tests.adversarial.test_in_process import OBFUSCATED

pytestmark = pytest.mark.integration

UTF7 = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,3 +1,5 @@
+import builtins
+builtins.ACAAPQA9ACAANQ = 6
 def add(a, b):
     return a - b
 
diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -3,7 +3,7 @@ from calc import add, mul
 
 
 def test_add():
-    assert add(2, 3) == 5
+    assert add(2, 3)+ACAAPQA9ACAANQ
 
 
 def test_mul():
diff --git a/.gitattributes b/.gitattributes
new file mode 100644
--- /dev/null
+++ b/.gitattributes
@@ -0,0 +1 @@
+tests/test_calc.py working-tree-encoding=UTF-7
"""

# the red team's in-process patch with its names in plain sight (the screen reads them once git shows text)
HOOK = OBFUSCATED["report-classmethod"].replace(
    'import importlib\n\n_r = importlib.import_module("_py" + "test.reports")', "import _pytest.reports as _r")
BINARY_SCREEN = ("diff --git a/.gitattributes b/.gitattributes\nnew file mode 100644\n--- /dev/null\n"
                 "+++ b/.gitattributes\n@@ -0,0 +1 @@\n+calc.py -diff\n" + make_patch("calc.py", BUGGY_CALC, HOOK + BUGGY_CALC))


@pytest.mark.parametrize("policy", ["reject", "drop"])
def test_a_re_encoded_test_edit_is_seen_and_scores_0(task_image: str, policy: str) -> None:
    verdict = verify(task_image, UTF7, f"gitattr-utf7-{policy}", tamper_policy=policy)
    assert verdict.reward == 0.0, verdict.notes
    record = verdict.evidence["submission"]
    assert {".gitattributes", "tests/test_calc.py"} <= set(record["protected_paths"]), record
    assert "+ACAAPQA9ACAANQ" in verdict.submission_patch  # what is stored is what would have run


def test_a_binary_diff_attribute_does_not_blind_the_screen(task_image: str) -> None:
    verdict = verify(task_image, BINARY_SCREEN, "gitattr-binary", tamper_policy="drop")
    assert verdict.reward == 0.0 and verdict.result is None, verdict.notes
    record = verdict.evidence["submission"]
    assert record["dropped_paths"] == [".gitattributes"] and record["tampering"]
    assert [(f["path"], f["kind"]) for f in record["screen_findings"]][:1] == [("calc.py", "test framework internals")]

