"""Prefect tasks of serving and evaluation: blue/green swap, agent (canary) trials."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from forgeflow import agent, serving, trial



@task(cache_policy=NO_CACHE)
def serve_swap(state_path: Path, gguf_path: Path, gguf_sha256: str, ports: tuple[int, int]) -> serving.SwapResult:
    """Start the GGUF on the idle port, gate it (models endpoint + smoke completion), switch the
    recorded endpoint and stop the old server; a failed gate keeps the old one and raises.
    Never cached: a server is a live process, not a result."""
    return serving.swap(state_path, gguf_path, gguf_sha256, ports=ports)


@task(cache_policy=NO_CACHE)
def stage_server(state_path: Path, gguf_path: Path, gguf_sha256: str, ports: tuple[int, int]) -> serving.StagedServer:
    """Start the GGUF on the idle port and gate it (health + smoke); the recorded endpoint does not
    move until :func:`promote_server`. A failed start/gate raises SwapRolledBackError."""
    return serving.stage(state_path, gguf_path, gguf_sha256, ports=ports)


@task(cache_policy=NO_CACHE)
def promote_server(state_path: Path, staged: serving.StagedServer) -> serving.SwapResult:
    """Record the staged server as the next serving generation and stop the old one."""
    return serving.promote(state_path, staged)


@task(cache_policy=NO_CACHE)
def discard_server(staged: serving.StagedServer) -> None:
    """Stop a staged server the gates refused; the recorded endpoint never moved."""
    serving.discard(staged)


@task(cache_policy=(INPUTS - "base_url") + TASK_SOURCE, task_run_name="agent-{instance_id}-{model_sha256:.12}")
def agent_trial(instance_id: str, image_ref: str, image_digest: str, problem_statement: str, test_command: str,
                fail_to_pass: list[str], pass_to_pass: list[str], base_url: str, model_alias: str,
                model_sha256: str, config: agent.AgentConfig, out_dir: Path, verifier_timeout_s: float) -> trial.TrialRecord:
    """One canary trial: mini-swe-agent on the host, commands in a no-network container, then the
    verifier. Cache key: model sha256 + image digest + agent/sampling config + the task's tests
    (not the endpoint URL: blue/green alternates ports for the same model).
    An infrastructure failure is recorded as the trial's exception, never as reward 0."""
    return agent.run_agent_trial(instance_id, image_ref, problem_statement, test_command, fail_to_pass,
                                 pass_to_pass, base_url, model_alias, config, out_dir,
                                 verifier_timeout_s=verifier_timeout_s, run_key=model_sha256)
