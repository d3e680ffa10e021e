"""Attack class: the agent controls the container its submission is taken from.

On the agent path the old submission was the agent's own ``git diff`` inside its container: a
replaced ``git`` binary, an external diff driver in ``.git/config`` or an alias can make that diff say
anything. Now the container is stopped and its tree copied out from the host
(:func:`forgeflow.sandbox.tree.export_tree`); the verifier's git in a fresh pristine container decides
what changed. Each variant below runs real commands in a real agent container (podman), then the
tree goes through :func:`forgeflow.sandbox.scoring.verify_submission`.

On Kubernetes (through the loopback fake of the API, tests/fakes/kubernetes_api.py: a fake of the API
that runs pods with podman, not a cluster) the agent's pod carries a ``tree`` sidecar of the pristine
image sharing the repository volume, and the same ``tar`` runs there
(:meth:`forgeflow.sandbox.kubernetes.KubernetesSandbox.export_tree`), reached through the product's
``take_submission``.
"""

from __future__ import annotations

import io
import tarfile

import pytest

from forgeflow.common import errors
from forgeflow.evaluation.agent import AgentPhase, take_submission
from forgeflow.evaluation.sandbox_env import SandboxEnvironment, SandboxEnvironmentConfig
from forgeflow.sandbox.backends import SandboxTarget
from forgeflow.sandbox.kubernetes import new_core_api
from forgeflow.sandbox.tree import TreeTooLargeError, export_tree
from tests.adversarial.calc_task import verify
from tests.kubefake import kubernetes_api

pytestmark = pytest.mark.integration

FIX = "sed -i 's/return a - b/return a + b/' calc.py"
FORCE_PASS = ("import pytest\\n\\n\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
              "    outcome = yield\\n    outcome.get_result().outcome = 'passed'\\n")
HIDE = [  # the agent's own tools lie about what changed
    "git config diff.external /bin/true",
    "printf '#!/bin/sh\\nexit 0\\n' > /tmp/git && chmod +x /tmp/git && cp /tmp/git /usr/bin/git",
    "git config alias.diff '!true'",
]


def _tree_of(image: str, name: str, commands: list[str]) -> bytes:
    env = SandboxEnvironment.start("podman", SandboxEnvironmentConfig(image=image, name=name, memory_mb=256))
    try:
        for command in commands:
            out = env.execute({"command": command})
            assert out["returncode"] == 0, (command, out)
        return export_tree(name)
    finally:
        env.stop()


def test_a_fix_with_scratch_files_scores_1_and_the_scratch_is_removed(task_image: str) -> None:
    tree = _tree_of(task_image, "ff-test-adv-agent-fix", [
        FIX, "printf 'def test_repro():\\n    pass\\n' > test_repro.py", "mkdir -p tests && touch tests/notes.txt",
        "git add -A && git -c user.name=a -c user.email=a@a commit -qm wip", *HIDE])
    verdict = verify(task_image, "", "agent-fix", tree=tree)
    assert verdict.reward == 1.0, verdict.notes
    record = verdict.evidence["submission"]
    assert record["source"] == "tree" and record["dropped_paths"] == ["test_repro.py", "tests/notes.txt"]
    assert "+    return a + b" in verdict.submission_patch and "calc.py" in verdict.submission_patch


@pytest.mark.parametrize(("label", "commands"), [
    ("new-conftest-hidden", [f"printf \"{FORCE_PASS}\" > tests/conftest.py", *HIDE]),
    ("edited-conftest", [f"printf \"{FORCE_PASS}\" >> conftest.py", *HIDE]),
    ("pyc-planted", ["python3 -c \"import py_compile; py_compile.compile('calc.py', cfile='__pycache__/x.pyc')\"",
                     *HIDE]),
])
def test_what_the_agents_tools_hide_is_seen_and_scores_0(task_image: str, label: str, commands: list[str]) -> None:
    tree = _tree_of(task_image, f"ff-test-adv-agent-{label}", commands)
    verdict = verify(task_image, "", f"agent-{label}", tree=tree)
    assert verdict.reward == 0.0, verdict.notes
    record = verdict.evidence["submission"]
    assert record["protected_paths"], record
    if label == "edited-conftest":  # the task's own file changed: tampering, not even run
        assert record["tampering"] and verdict.result is None
    else:  # new files of the agent's are removed; the tests run on the task's own and fail
        assert verdict.result is not None and verdict.result.tests["tests/test_calc.py::test_add"] == "FAILED"


# --- Kubernetes: the tree taken in the pod's sidecar ------------------------------------------------
EDITS = [  # one of each kind of change a tar carries: content, new file, deletion, mode, link, odd name
    FIX, "printf 'x\\n' > 'new file ü.txt' && mkdir -p pkg/sub && printf 'y\\n' > pkg/sub/mod.py",
    "rm tests/test_env.py", "chmod 755 conftest.py", "ln -s calc.py link.py", "printf 's\\n' > secret && chmod 000 secret",
]
ESCAPES = [  # what an agent in its pod tries against the sidecar: it sees none of its processes
    "kill -9 -1; kill -9 1; kill 1; true",
    "for r in /proc/[0-9]*/root/usr/bin; do cp /bin/true \"$r/tar\" 2>/dev/null; done; true",
]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory):
    with kubernetes_api(tmp_path_factory.mktemp("kube")) as fake:
        yield fake
        assert fake.pods() == [] and fake.containers() == [] and fake.volumes() == []


def _kube_env(kube, image: str, name: str) -> SandboxEnvironment:
    target = SandboxTarget(kind="kubernetes", kubeconfig=str(kube.kubeconfig))
    return SandboxEnvironment.start(target, SandboxEnvironmentConfig(image=image, backend="kubernetes", name=name,
                                                                     memory_mb=256))


def _run(env: SandboxEnvironment, commands: list[str]) -> None:
    for command in commands:
        out = env.execute({"command": command})
        assert out["returncode"] == 0, (command, out)


def _members(tree: bytes) -> dict[str, tuple]:
    """Each tar member's name -> (type, mode, uid, gid, link target, content): all but the times."""
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        return {m.name: (m.type, m.mode, m.uid, m.gid, m.linkname, tar.extractfile(m).read() if m.isfile() else None)
                for m in tar.getmembers()}


def test_on_kubernetes_the_agents_tools_cannot_hide_its_change(task_image: str, kube) -> None:
    env = _kube_env(kube, task_image, "ff-test-adv-k8s-agent-fix")
    try:
        _run(env, [FIX, "printf 'def test_repro():\\n    pass\\n' > test_repro.py", *HIDE, *ESCAPES])
        assert env.execute({"command": "git diff"})["output"] == "", "the agent's own git hides the fix"
        phase = AgentPhase()
        take_submission(env, phase)
        assert phase.error is None and phase.tree is not None, (phase.error, phase.notes)
        with pytest.raises(TreeTooLargeError):  # the same bound as podman's
            env.sandbox.export_tree(max_bytes=1024)
    finally:
        env.stop()
    verdict = verify(task_image, phase.submission, "k8s-agent-fix", tree=phase.tree)
    assert verdict.reward == 1.0, verdict.notes
    assert verdict.evidence["submission"]["dropped_paths"] == ["test_repro.py"]
    assert "+    return a + b" in verdict.submission_patch
    taken = [c for c in kube.calls() if c["verb"] == "exec" and c["name"] == env.config.name and c["command"][0] == "tar"]
    assert [c["container"] for c in taken] == ["tree", "tree"], "tar ran in the sidecar, never the agent's container"


def test_the_tree_taken_on_kubernetes_equals_the_tree_taken_on_podman(task_image: str, kube) -> None:
    podman = _tree_of(task_image, "ff-test-adv-k8s-same-podman", EDITS)
    env = _kube_env(kube, task_image, "ff-test-adv-k8s-same")
    try:
        _run(env, EDITS)
        phase = AgentPhase()
        take_submission(env, phase)
        assert phase.error is None and phase.tree is not None
        # the bytes reach a pod as they are (a verifier's pod puts the tree in place this way)
        env.sandbox.write_file("/tmp/tree.tar", phase.tree)
        listed = env.sandbox.exec(["tar", "-tf", "/tmp/tree.tar"], timeout_s=30)
        assert listed.exit_code == 0 and "./new file ü.txt" in listed.stdout.splitlines()
    finally:
        env.stop()
    ours, theirs = _members(phase.tree), _members(podman)
    assert ours == theirs
    assert {"./new file ü.txt", "./pkg/sub/mod.py", "./link.py", "./secret"} <= set(ours)
    assert "./tests/test_env.py" not in ours and not any(name.startswith("./.git") for name in ours)
    assert ours["./conftest.py"][1] == 0o755 and ours["./secret"][1:2] == (0,) and ours["./secret"][5] == b"s\n"


def test_on_kubernetes_a_pod_gone_or_evicted_before_its_tree_is_an_exception_not_0(task_image: str, kube) -> None:
    envs = [_kube_env(kube, task_image, f"ff-test-adv-k8s-{how}") for how in ("evicted", "deleted")]
    try:
        kube.evict(envs[0].config.name)
        new_core_api(str(kube.kubeconfig)).delete_namespaced_pod(envs[1].config.name, "forgeflow",
                                                                 grace_period_seconds=0)
        for env, evidence in zip(envs, ("evicted", "gone")):
            phase = AgentPhase()
            take_submission(env, phase)
            assert isinstance(phase.error, errors.SandboxError) and evidence in str(phase.error), phase.error
            assert phase.tree is None and not phase.notes
    finally:
        for env in envs:
            env.stop()
