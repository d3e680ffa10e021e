"""The agent's environment (:class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`) on both
sandbox backends: a real podman container, and a pod of the loopback fake of the Kubernetes API
(tests/fakes/kubernetes_api.py: a fake of the API that runs pods with podman, not a cluster; every
call goes through the official client).

Checks what mini-swe-agent's agent relies on (the shape of ``execute``'s answer, stderr merged in
order, a timeout as returncode -1 with ``exception_info``, the submission marker raising
``Submitted``) and what forgeflow adds (``git`` in /testbed, the watchdog's kill of a stuck
command leaving the container usable, ``stop`` removing it).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent import task_image  # noqa: E402,F401 - fixture

from forgeflow.evaluation.mswea import prepare_mswea_env  # noqa: E402
from forgeflow.evaluation.sandbox_env import SandboxEnvironment, SandboxEnvironmentConfig  # noqa: E402
from forgeflow.sandbox.backends import SandboxTarget  # noqa: E402
from tests.kubefake import kubernetes_api  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(params=["podman", "kubernetes"])
def environment(request, task_image: str, tmp_path: Path) -> Iterator[tuple[SandboxEnvironment, object]]:
    """A started environment of the calc task image on each backend (and the fake, for kubernetes)."""
    prepare_mswea_env()
    config = SandboxEnvironmentConfig(image=task_image, backend=request.param, name=f"ff-test-sandbox-env-{request.param}",
                                      memory_mb=512, env={"PAGER": "cat"})
    if request.param == "podman":
        env = SandboxEnvironment.start("podman", config)
        try:
            yield env, None
        finally:
            env.stop()
        return
    with kubernetes_api(tmp_path) as fake:
        env = SandboxEnvironment.start(SandboxTarget(kind="kubernetes", kubeconfig=str(fake.kubeconfig)), config)
        try:
            yield env, fake
        finally:
            env.stop()
        assert fake.pods() == [] and fake.containers() == []


def test_execute_answers_as_mini_swe_agents_docker_environment(environment) -> None:
    from minisweagent.exceptions import Submitted

    env, _ = environment
    out = env.execute({"command": "echo one; echo two >&2; echo $PAGER; pwd; exit 3"})
    assert out == {"output": "one\ntwo\ncat\n/testbed\n", "returncode": 3, "exception_info": ""}
    timed_out = env.execute({"command": "sleep 30"}, timeout=1)
    assert timed_out["returncode"] == -1 and timed_out["output"] == ""
    assert timed_out["exception_info"] == ("An error occurred while executing the command: Command 'sleep 30' "
                                           "timed out after 1 seconds")
    assert timed_out["extra"]["exception_type"] == "VerifierTimeoutError"
    assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
    with pytest.raises(Submitted) as submitted:
        env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the-patch"})
    assert submitted.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the-patch\n"}
    # the marker with a failing exit is not a submission
    assert env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"})["returncode"] == 1
    assert len(env.git("rev-parse", "HEAD").strip()) == 40
    info = env.serialize()["info"]["config"]
    assert info["environment_type"] == "forgeflow.evaluation.sandbox_env.SandboxEnvironment"
    assert info["environment"]["backend"] == env.config.backend and env.get_template_vars()["cwd"] == "/testbed"


def test_the_interrupt_kills_a_stuck_command_and_the_container_stays(environment) -> None:
    env, fake = environment
    env.execute({"command": "echo changed >> calc.py"})
    answer: dict = {}
    stuck = threading.Thread(target=lambda: answer.update(env.execute({"command": "sleep 300"}, timeout=600)))
    stuck.start()
    time.sleep(3)
    started = time.monotonic()
    env.interrupt()  # from another thread, as the hang watchdog calls it
    stuck.join(60)
    assert not stuck.is_alive() and time.monotonic() - started < 30
    assert answer["returncode"] == 137, answer  # SIGKILL: the command returned
    assert "changed" in env.git("diff"), "the container kept the agent's work for the submission"
    if fake is not None:  # the kill went through the exec subresource of the agent's pod
        kills = [c for c in fake.calls() if c["verb"] == "exec" and "kill -KILL" in " ".join(c["command"])]
        assert [c["name"] for c in kills] == [env.config.name]
    env.stop()
    env.interrupt()  # after stop: nothing to do, no error
