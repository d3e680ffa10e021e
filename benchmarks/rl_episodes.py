"""Agentic RL episodes per minute: forgeflow's episode runner beside mini-swe-agent alone, same solver, same task.

Run ``python -m benchmarks.rl_episodes [--episodes 4] [--concurrency 2]``. It prints one human line per driver
and, as the LAST line, one JSON object::

    {"rl_episodes": {"episodes": ..., "turns": ..., "forgeflow_episodes_per_min": ...,
                     "forgeflow_concurrent_episodes_per_min": ..., "concurrency": ...,
                     "mswea_episodes_per_min": ..., "mswea_graded_episodes_per_min": ...,
                     "forgeflow_vs_mswea_graded": ..., "verify_s_mean": ...}}

The same scripted solver (``cat calc.py``, the ``sed`` fix, the tests, then the submit command; each answer a
THOUGHT paragraph and one ```` ```mswea_bash_command ```` block, :func:`benchmarks.scale_agent.answer_text`)
solves the calc task (``tests/adversarial/calc_task.py``, its image built once) ``--episodes`` times:

* ``forgeflow``: :func:`forgeflow.training.episodes_run.run_episodes` with a
  :class:`~forgeflow.training.episodes.ScriptedPolicy` (token ids through the tiny model's Qwen2 tokenizer, the
  prefix check, the loop detector and hang watchdog, trajectories and token records written, the tree taken and
  the verifier run in a fresh pristine container): once one episode at a time, once ``--concurrency`` at a time;
* ``mswea``: mini-swe-agent 2.4.6's own ``DefaultAgent`` and ``LitellmTextbasedModel`` answered by a scripted
  OpenAI-compatible endpoint (:class:`benchmarks.scale_agent.LongEndpoint`) on the same kind of container
  (:class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`), one episode at a time; after each run the
  same tree is taken and the same verifier run (:func:`forgeflow.evaluation.agent.take_submission`,
  :func:`forgeflow.sandbox.dispatch.verify_on`), timed apart: ``mswea_episodes_per_min`` counts the container
  and the agent loop only (mini-swe-agent alone grades nothing), ``mswea_graded_episodes_per_min`` adds the
  verifier (the same work as an RL episode).

``forgeflow_vs_mswea_graded`` = forgeflow's sequential rate / mini-swe-agent's graded rate (1.0: no cost).
One episode of each driver runs first, untimed (caches warm).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.options import int_option
from benchmarks.scale_agent import LongEndpoint, agent_config, answer_text, calc_agent_task, ensure_calc_image

COMMANDS = ["cat calc.py", "sed -i 's/return a - b/return a + b/' calc.py",
            "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -5"]
VERIFIER_TIMEOUT_S = 120.0
MEMORY_MB = 512


def solver_commands() -> list[str]:
    """The solver's commands, the submit command last (:data:`forgeflow.training.episodes.SUBMIT_COMMAND`)."""
    from forgeflow.training.episodes import SUBMIT_COMMAND  # noqa: PLC0415

    return [*COMMANDS, SUBMIT_COMMAND]


class _PerEpisode:
    """A fresh :class:`~forgeflow.training.episodes.ScriptedPolicy` per episode (an episode's first turn has no
    assistant message yet), kept per thread of the step's pool."""

    def __init__(self, tokens: Any, answers: list[str]) -> None:
        self.tokens, self.answers, self.mine, self.lock = tokens, answers, {}, threading.Lock()

    def sample(self, context_ids: list[int], messages: list[dict[str, Any]]) -> Any:
        from forgeflow.training.episodes import ScriptedPolicy  # noqa: PLC0415

        with self.lock:
            if not any(m["role"] == "assistant" for m in messages):
                self.mine[threading.get_ident()] = ScriptedPolicy(self.tokens, self.answers)
            policy = self.mine[threading.get_ident()]
        return policy.sample(context_ids, messages)


def run_forgeflow(image: str, episodes: int, concurrency: int, out_dir: Path) -> dict[str, Any]:
    """``episodes`` episodes of the solver through forgeflow's episode runner, ``concurrency`` at a time.

    Raises:
        RuntimeError: an episode was not rewarded 1.0 (the measurement would not be of the same work).
    """
    from transformers import AutoTokenizer  # noqa: PLC0415

    from forgeflow.common.settings import cache_dir  # noqa: PLC0415
    from forgeflow.packaging.base_model import build_tiny_model  # noqa: PLC0415
    from forgeflow.training.episodes import EPISODE_PROMPT_TEMPLATE, EpisodeSettings, EpisodeTokens  # noqa: PLC0415
    from forgeflow.training.episodes_run import episode_messages, run_episodes  # noqa: PLC0415

    tiny = build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0).path
    tokens = EpisodeTokens(AutoTokenizer.from_pretrained(str(tiny)))
    answers = [answer_text(i, c) for i, c in enumerate(solver_commands())]
    task = calc_agent_task(image)
    messages = episode_messages(task.problem_statement, EPISODE_PROMPT_TEMPLATE.read_text(encoding="utf-8"))
    settings = EpisodeSettings(max_turns=len(answers) + 2, max_tokens=32768, concurrency=concurrency,
                               memory_mb=MEMORY_MB, command_timeout_s=30, wall_s=300)
    t0 = time.monotonic()
    done = run_episodes([(task, messages)] * episodes, _PerEpisode(tokens, answers), tokens, settings, out_dir,
                        {"backend": "podman", "verifier_timeout_s": VERIFIER_TIMEOUT_S})
    wall_s = time.monotonic() - t0
    bad = [(e.end_reason, e.reward, e.exception_type, e.exception_message) for e in done if e.reward != 1.0]
    if bad:
        raise RuntimeError(f"forgeflow's episodes did not all score 1.0: {bad}")
    return {"wall_s": wall_s, "episodes_per_min": 60.0 * episodes / wall_s, "turns": sum(len(e.turns) for e in done)}


def _mswea_episode(image: str, out_dir: Path, index: int) -> tuple[float, float]:
    """One mini-swe-agent episode (container, agent loop), then forgeflow's verifier on its tree; returns
    (seconds without the verifier, the verifier's seconds)."""
    from forgeflow.evaluation.agent import AgentPhase, take_submission  # noqa: PLC0415
    from forgeflow.evaluation.mswea import mswea_config, prepare_mswea_env  # noqa: PLC0415
    from forgeflow.evaluation.sandbox_env import SandboxEnvironment, environment_config  # noqa: PLC0415
    from forgeflow.sandbox.base import SandboxSpec  # noqa: PLC0415
    from forgeflow.sandbox.dispatch import verify_on  # noqa: PLC0415

    prepare_mswea_env()
    import litellm  # noqa: PLC0415
    from minisweagent.agents.default import DefaultAgent  # noqa: PLC0415
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel  # noqa: PLC0415

    litellm.suppress_debug_info = True
    task = calc_agent_task(image)
    config = agent_config(len(COMMANDS) + 1, memory_mb=MEMORY_MB, command_timeout_s=30)
    endpoint = LongEndpoint(solver_commands())
    with endpoint.serve():
        cfg = mswea_config(image, endpoint.url, "scripted", config)
        model_cfg = {**cfg["model"], "model_name": "openai/scripted",
                     "model_kwargs": {**cfg["model"]["model_kwargs"], "api_key": "none"}}
        model_cfg["model_kwargs"].pop("seed", None)
        t0 = time.monotonic()
        env = SandboxEnvironment.start("podman", environment_config(
            cfg["environment"], image=image, backend="podman", name=f"ff-bench-rlmswea-{index}-{int(time.time())}",
            memory_mb=config.memory_mb, cpus=config.cpus))
        try:
            agent = DefaultAgent(LitellmTextbasedModel(**model_cfg), env,
                                 output_path=out_dir / f"mswea-{index}.traj.json", **cfg["agent"])
            result = agent.run(task.problem_statement)
            loop_s = time.monotonic() - t0
            t1 = time.monotonic()
            phase = AgentPhase()
            take_submission(env, phase)
            if phase.error is not None:
                raise phase.error
            verdict = verify_on(None, task, phase.submission, timeout_s=VERIFIER_TIMEOUT_S,
                                spec=SandboxSpec(memory_mb=MEMORY_MB, cpus=config.cpus),
                                name=f"ff-bench-rlmsweaverify-{index}-{int(time.time())}", backend="podman",
                                tree=phase.tree)
        finally:
            env.stop()
        verify_s = time.monotonic() - t1
    if result.get("exit_status") != "Submitted" or verdict.reward != 1.0:
        raise RuntimeError(f"mini-swe-agent's episode did not solve the task: {result}, reward {verdict.reward}")
    return loop_s, verify_s


def run_mswea(image: str, episodes: int, out_dir: Path) -> dict[str, Any]:
    """``episodes`` mini-swe-agent episodes, one at a time, each graded after (timed apart)."""
    loops, verifies = zip(*(_mswea_episode(image, out_dir, i) for i in range(episodes)), strict=True)
    return {"episodes_per_min": 60.0 * episodes / sum(loops),
            "graded_episodes_per_min": 60.0 * episodes / (sum(loops) + sum(verifies)),
            "verify_s_mean": sum(verifies) / episodes}


def measure(episodes: int, concurrency: int) -> dict[str, Any]:
    """Run the three measurements (forgeflow sequential, forgeflow concurrent, mini-swe-agent sequential).

    Args:
        episodes: episodes per measurement (>= 1).
        concurrency: forgeflow's concurrent run's episodes at once (>= 1).

    Returns:
        The ``rl_episodes`` section of the benchmark's JSON line (rates in episodes per minute).

    Raises:
        RuntimeError: a driver's episode did not solve the task (reward 1.0).
    """
    image = ensure_calc_image()
    with tempfile.TemporaryDirectory(prefix="ff-bench-rl-") as tmp:
        root = Path(tmp)
        run_forgeflow(image, 1, 1, root / "warm-up")  # untimed: podman's and the tokenizer's caches warm
        _mswea_episode(image, root, -1)
        seq = run_forgeflow(image, episodes, 1, root / "forgeflow")
        print(f"forgeflow (1 at a time): {seq['episodes_per_min']:.2f} episodes/min over {episodes}", flush=True)
        par = run_forgeflow(image, episodes, concurrency, root / "forgeflow-concurrent")
        print(f"forgeflow ({concurrency} at a time): {par['episodes_per_min']:.2f} episodes/min", flush=True)
        ms = run_mswea(image, episodes, root)
        print(f"mini-swe-agent alone: {ms['episodes_per_min']:.2f} episodes/min ungraded, "
              f"{ms['graded_episodes_per_min']:.2f} graded", flush=True)
    return {"episodes": episodes, "turns": seq["turns"] // episodes,
            "forgeflow_episodes_per_min": round(seq["episodes_per_min"], 2),
            "forgeflow_concurrent_episodes_per_min": round(par["episodes_per_min"], 2), "concurrency": concurrency,
            "mswea_episodes_per_min": round(ms["episodes_per_min"], 2),
            "mswea_graded_episodes_per_min": round(ms["graded_episodes_per_min"], 2),
            "forgeflow_vs_mswea_graded": round(seq["episodes_per_min"] / ms["graded_episodes_per_min"], 3),
            "verify_s_mean": round(ms["verify_s_mean"], 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``--episodes`` / ``--concurrency``, measure, print the JSON line; returns it as a dict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int_option(1, 100), default=4)
    parser.add_argument("--concurrency", type=int_option(1, 16), default=2)
    args = parser.parse_args(argv)
    result = {"rl_episodes": measure(args.episodes, args.concurrency)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
