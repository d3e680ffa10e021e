"""The long-horizon part of the scale benchmark: an agent's per-step overhead over mini-swe-agent alone.

Run ``python -m benchmarks.scale_agent [--steps 200] [--repeats 1]``. It prints one human line per run
and, as the LAST line, one JSON object::

    {"agent": {"steps": ..., "forgeflow_s_per_step": ..., "mswea_s_per_step": ..., "overhead": ...,
               "last_prompt_tokens": ..., "total_prompt_tokens": ..., "trajectory_bytes": ...,
               "stream_bytes": ..., "peak_rss_mb": ..., "tokenizer": ...}, "goals": {...}}

A scripted OpenAI-compatible endpoint (:class:`LongEndpoint`, stdlib ``http.server`` on 127.0.0.1) replays
a realistic trajectory of ``--steps`` steps (:func:`long_script`: ``ls``, ``grep -rn``, ``sed -n``, ``cat``,
``python3 -c``, ``wc``, edits, test runs, then the submission) whose observations are real command output
of a few KB, so the conversation passes 100K tokens by step 200 (counted with the Qwen2 tokenizer forgeflow
builds, :func:`forgeflow.packaging.base_model.ensure_tokenizer`, when it is on the machine; else about 4
bytes a token). The same script drives, against the calc task image (``tests/adversarial/calc_task.py``):

* ``forgeflow``: :func:`forgeflow.evaluation.agent.run_agent_trial` (supervised agent, hang watchdog,
  context budget, trajectory streamed, ModelClient; the verifier after it is not timed);
* ``mswea``: mini-swe-agent 2.4.6's own ``DefaultAgent`` with its own ``LitellmTextbasedModel`` (LiteLLM)
  driving the same kind of container through :class:`forgeflow.evaluation.sandbox_env.SandboxEnvironment`,
  no supervision, its trajectory saved each step as it does by itself.

``*_s_per_step``: the agent loop's wall seconds (container start excluded) over its model calls; ``overhead``
= forgeflow / mswea - 1 (goal <= 0.05, issue 34). ``peak_rss_mb``: this process's peak resident memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.options import int_option

STDLIB = "/usr/lib/python3.11"
FILES = ("json/decoder.py", "json/encoder.py", "argparse.py", "textwrap.py", "difflib.py", "ast.py",
         "functools.py", "dataclasses.py", "inspect.py", "string.py", "shlex.py", "fractions.py")
PACKAGES = ("json", "email", "logging", "unittest", "importlib", "concurrent/futures", "http", "xml/etree")
NAMES = ("decode", "encode", "parse", "format", "load", "dump", "get", "add", "make", "read", "write", "close")
MODULES = ("json", "textwrap", "difflib", "ast", "functools", "string", "shlex", "fractions", "argparse", "inspect")
THOUGHT = ("THOUGHT: {why} The failing test is tests/test_calc.py::test_add, so I want to understand how the "
           "project is laid out and how the code it relies on behaves before I change anything; the output of "
           "this command tells me whether my reading of the code so far is right. {n}")
WHY = ("I should look at the surrounding code first.", "Let me compare this with how the standard library does it.",
       "I need to see the definitions that match this name.", "Let me check the size of these modules.",
       "I want to see what this module exposes.", "Let me read the next part of this file.")

Counter = Callable[[str], int]
"""Text -> its token count."""


def byte_counter(text: str) -> int:
    """About 4 UTF-8 bytes a token (the fallback where no tokenizer is on the machine)."""
    return len(text.encode("utf-8")) // 4 + 1


def qwen2_counter() -> tuple[Counter, str]:
    """The Qwen2 tokenizer's count (the tokenizer forgeflow builds, read with ``tokenizers``), or
    :func:`byte_counter` when it was never built here; returns (counter, its name)."""
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415

        from forgeflow.packaging.base_model import tokenizer_dir  # noqa: PLC0415

        path = tokenizer_dir() / "tokenizer.json"
        if path.is_file():
            tok = Tokenizer.from_file(str(path))
            return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), "qwen2"
    except ImportError:
        pass
    return byte_counter, "bytes/4"


def long_script(n_steps: int) -> list[str]:
    """The commands of a realistic ``n_steps``-step trajectory on the calc task (no command twice).

    Explores the repository and the standard library (``sed -n`` windows, ``grep -rn``, ``wc``, ``python3 -c``,
    ``ls``), then fixes ``calc.py`` (``sed -i``), checks it (``git diff``, the tests) and submits (the last
    command prints mini-swe-agent's submission marker).

    Raises:
        ValueError: ``n_steps < 8``.
    """
    if n_steps < 8:
        raise ValueError(f"n_steps must be >= 8, got {n_steps}")
    head = ["ls -la", "cat calc.py", "cat tests/test_calc.py",
            "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -15"]
    tail = ["sed -i 's/return a - b/return a + b/' calc.py", "git diff",
            "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -5",
            "git diff -- calc.py > /tmp/patch.txt; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /tmp/patch.txt"]
    middle: list[str] = []
    i = 0
    while len(middle) < n_steps - len(head) - len(tail):
        kind = i % 6
        if kind in (0, 5):
            path = FILES[(i // 6) % len(FILES)]
            start = 1 + 100 * (i // (6 * len(FILES)) + (kind == 5) * 4)
            middle.append(f"sed -n '{start},{start + 99}p' {STDLIB}/{path}")
        elif kind == 1:
            middle.append(f'grep -rn "def {NAMES[i % len(NAMES)]}" {STDLIB}/{PACKAGES[i % len(PACKAGES)]}/ | head -80'
                          f"  # {i}")
        elif kind == 2:
            middle.append(f"wc -l {STDLIB}/{PACKAGES[i % len(PACKAGES)]}/*.py  # {i}")
        elif kind == 3:
            mod = MODULES[i % len(MODULES)]
            middle.append(f'python3 -c "import {mod}; print(sorted(dir({mod})))"  # {i}')
        else:
            middle.append(f"ls -la {STDLIB}/{PACKAGES[i % len(PACKAGES)]}  # {i}")
        i += 1
    return head + middle + tail


def answer_text(index: int, command: str) -> str:
    """The assistant's reply of step ``index``: a THOUGHT paragraph and the command in mini-swe-agent's fence."""
    thought = THOUGHT.format(why=WHY[index % len(WHY)], n=f"(step {index + 1})")
    return f"{thought}\n\n```mswea_bash_command\n{command}\n```"


class LongEndpoint:
    """A scripted OpenAI-compatible endpoint replaying :func:`long_script` (llama-server's shape).

    ``POST /v1/chat/completions``: request ``i`` is answered with reply ``i`` of the script (the last one
    again past its end), with ``usage`` counted by ``counter`` (per message: its content + 5 template tokens,
    + 3 for the generation prompt). A request whose prompt + ``max_tokens`` exceeds ``slot_tokens`` gets
    llama-server's 400 ("exceeds the available context size") and is counted in :attr:`overflows`.
    ``GET /props``: ``default_generation_settings.n_ctx`` = ``slot_tokens`` (404 when None).
    ``POST /tokenize`` (``{"content"}``): ``{"tokens": [...]}`` of ``counter``'s length.

    Attributes:
        url: the base URL (``http://127.0.0.1:<port>/v1``) once started.
        prompt_tokens: the prompt tokens of every request answered, in order.
        overflows: requests refused for the slot.
        tokenize_calls: ``/tokenize`` requests served.
        stream_lines: with ``watch`` (a folder), the lines its ``*.messages.jsonl`` held at each request answered.
    """

    def __init__(self, commands: list[str], counter: Counter = byte_counter, slot_tokens: int | None = None,
                 watch: Path | None = None) -> None:
        self.replies = [answer_text(i, c) for i, c in enumerate(commands)]
        self.watch = watch
        self.stream_lines: list[int] = []
        self.counter = counter
        self.slot_tokens = slot_tokens
        self.prompt_tokens: list[int] = []
        self.overflows = 0
        self.tokenize_calls = 0
        self.url = ""
        self._cache: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        """The prompt tokens of ``messages`` (each content counted once, then cached by its digest)."""
        total = 3
        for message in messages:
            content = str(message.get("content") or "")
            key = hashlib.blake2b(content.encode("utf-8"), digest_size=16).digest()
            if key not in self._cache:
                self._cache[key] = self.counter(content)
            total += self._cache[key] + 5
        return total

    def _reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            prompt = self.count_messages(body["messages"])
            if self.slot_tokens is not None and prompt + int(body.get("max_tokens") or 0) > self.slot_tokens:
                self.overflows += 1
                return 400, {"error": {"code": 400, "type": "exceed_context_size_error", "message": (
                    f"the request exceeds the available context size ({prompt} tokens, slot {self.slot_tokens})")}}
            index = len(self.prompt_tokens)
            self.prompt_tokens.append(prompt)
            if self.watch is not None:
                streams = self.watch.glob("*.messages.jsonl")
                self.stream_lines.append(sum(len(p.read_bytes().splitlines()) for p in streams))
        content = self.replies[min(index, len(self.replies) - 1)]
        return 200, {"id": f"scripted-{index}", "object": "chat.completion", "model": "scripted",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": content}}],
                     "usage": {"prompt_tokens": prompt, "completion_tokens": self.counter(content) + 1,
                               "total_tokens": prompt + self.counter(content) + 1}}

    @contextmanager
    def serve(self) -> Iterator[LongEndpoint]:
        """Serve on a free loopback port for the ``with`` block; yields self (:attr:`url` set)."""
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/").endswith("/props"):
                    if endpoint.slot_tokens is None:
                        return self._send(404, {"error": {"code": 404, "message": "File Not Found"}})
                    return self._send(200, {"default_generation_settings": {"n_ctx": endpoint.slot_tokens},
                                            "total_slots": 1, "model_path": "scripted.gguf"})
                return self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.rstrip("/").endswith("/tokenize"):
                    with endpoint._lock:
                        endpoint.tokenize_calls += 1
                    return self._send(200, {"tokens": [0] * endpoint.counter(str(body.get("content", "")))})
                self._send(*endpoint._reply(body))

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


def calc_agent_task(image: str) -> Any:
    """The calc task (``tests/adversarial/calc_task.py``) as an agent trial's
    :class:`forgeflow.sandbox.verifier.TaskTests`."""
    from forgeflow.sandbox.verifier import TaskTests  # noqa: PLC0415
    from tests.adversarial.calc_task import F2P, P2P, TEST_COMMAND  # noqa: PLC0415

    return TaskTests(instance_id="calc-long", image_ref=image, problem_statement="test_add fails: fix add in calc.py",
                     test_command=TEST_COMMAND, FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P)


def agent_config(n_steps: int, **overrides: Any) -> Any:
    """The AgentConfig of a long run: room for ``n_steps`` calls, a 5 s command timeout, 512 MiB."""
    from forgeflow.evaluation.agent import AgentConfig  # noqa: PLC0415

    return AgentConfig(**{"step_limit": n_steps + 5, "agent_timeout_s": 1800, "memory_mb": 512,
                          "command_timeout_s": 20, "max_tokens": 512, **overrides})


def run_forgeflow(endpoint: LongEndpoint, image: str, n_steps: int, out_dir: Path) -> dict[str, Any]:
    """One :func:`forgeflow.evaluation.agent.run_agent_trial`; the agent loop's seconds per model call."""
    from forgeflow.evaluation.agent import run_agent_trial  # noqa: PLC0415

    record = run_agent_trial(calc_agent_task(image), endpoint.url, "scripted", agent_config(n_steps), out_dir)
    if record.exception_type is not None or record.reward != 1.0:
        raise RuntimeError(f"forgeflow's run did not complete: {record.exception_type}: {record.exception_message}")
    traj = out_dir / f"{record.trial_id}.traj.json"
    stream = json.loads(traj.read_text(encoding="utf-8"))["info"]["forgeflow"]["stream"]
    return {"s_per_step": (record.agent_s - record.env_setup_s) / record.agent_steps, "steps": record.agent_steps,
            "trajectory_bytes": traj.stat().st_size, "stream_bytes": stream["bytes"],
            "input_tokens": record.input_tokens}


def run_mswea(endpoint: LongEndpoint, image: str, n_steps: int, out_dir: Path) -> dict[str, Any]:
    """mini-swe-agent alone: its DefaultAgent and LiteLLM model on a SandboxEnvironment of ``image``."""
    from forgeflow.evaluation.mswea import mswea_config, prepare_mswea_env  # noqa: PLC0415
    from forgeflow.evaluation.sandbox_env import SandboxEnvironment, environment_config  # noqa: PLC0415

    prepare_mswea_env()
    import litellm  # noqa: PLC0415
    from minisweagent.agents.default import DefaultAgent  # noqa: PLC0415
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel  # noqa: PLC0415

    litellm.suppress_debug_info = True  # its "Provider List" banner on every cost lookup of an unknown model

    config = agent_config(n_steps)
    cfg = mswea_config(image, endpoint.url, "scripted", config)
    model_cfg = {**cfg["model"], "model_name": "openai/scripted",
                 "model_kwargs": {**cfg["model"]["model_kwargs"], "api_key": "none"}}
    model_cfg["model_kwargs"].pop("seed", None)
    env = SandboxEnvironment.start("podman", environment_config(
        cfg["environment"], image=image, backend="podman", name=f"ff-bench-mswea-{int(time.time())}",
        memory_mb=config.memory_mb, cpus=config.cpus))
    try:
        agent = DefaultAgent(LitellmTextbasedModel(**model_cfg), env, output_path=out_dir / "mswea.traj.json",
                             **cfg["agent"])
        t0 = time.monotonic()
        result = agent.run("test_add fails: fix add in calc.py")
        loop_s = time.monotonic() - t0
    finally:
        env.stop()
    if result.get("exit_status") != "Submitted":
        raise RuntimeError(f"mini-swe-agent's run did not complete: {result}")
    return {"s_per_step": loop_s / agent.n_calls, "steps": agent.n_calls,
            "trajectory_bytes": (out_dir / "mswea.traj.json").stat().st_size}


def ensure_calc_image() -> str:
    """The calc task image of the adversarial corpus, built once (``tests/adversarial/calc_task.py``)."""
    from tests.adversarial.calc_task import (  # noqa: PLC0415
        BUGGY_CALC,
        CONFTEST,
        ENV_TEST,
        TASK_IMAGE,
        TESTS,
        build_task_image,
    )

    with tempfile.TemporaryDirectory(prefix="ff-bench-calc-") as tmp:
        return build_task_image(Path(tmp), TASK_IMAGE, {"calc.py": BUGGY_CALC, "tests/test_calc.py": TESTS,
                                                       "tests/test_env.py": ENV_TEST, "conftest.py": CONFTEST})


def measure(n_steps: int, repeats: int = 1, profile: Path | None = None) -> dict[str, Any]:
    """Run both drivers ``repeats`` times (alternating) on one endpoint script; the best run of each.

    Args:
        n_steps: steps of the scripted trajectory (>= 8).
        repeats: runs of each driver (the fastest is kept: the machine is shared).
        profile: where to write a cProfile of forgeflow's first run (pstats file); None: no profile.

    Returns:
        The ``agent`` section of the benchmark's JSON line.
    """
    counter, tokenizer = qwen2_counter()
    image = ensure_calc_image()
    commands = long_script(n_steps)
    ff: list[dict[str, Any]] = []
    ms: list[dict[str, Any]] = []
    last_prompt = total_prompt = 0
    for attempt in range(repeats):
        for name, runner, results in (("forgeflow", run_forgeflow, ff), ("mswea", run_mswea, ms)):
            endpoint = LongEndpoint(commands, counter, slot_tokens=1 << 20)
            with tempfile.TemporaryDirectory(prefix=f"ff-bench-{name}-") as tmp, endpoint.serve():
                if profile is not None and attempt == 0 and name == "forgeflow":
                    import cProfile  # noqa: PLC0415

                    with cProfile.Profile() as prof:
                        results.append(runner(endpoint, image, n_steps, Path(tmp)))
                    prof.dump_stats(str(profile))
                else:
                    results.append(runner(endpoint, image, n_steps, Path(tmp)))
            last_prompt, total_prompt = endpoint.prompt_tokens[-1], sum(endpoint.prompt_tokens)
            print(f"{name}: {results[-1]['s_per_step'] * 1000:.1f} ms/step over {results[-1]['steps']} steps, "
                  f"last prompt {last_prompt} tokens", flush=True)
    best_ff = min(ff, key=lambda r: r["s_per_step"])
    best_ms = min(ms, key=lambda r: r["s_per_step"])
    return {"steps": best_ff["steps"], "forgeflow_s_per_step": round(best_ff["s_per_step"], 5),
            "mswea_s_per_step": round(best_ms["s_per_step"], 5),
            "overhead": round(best_ff["s_per_step"] / best_ms["s_per_step"] - 1, 4),
            "last_prompt_tokens": last_prompt, "total_prompt_tokens": total_prompt,
            "trajectory_bytes": best_ff["trajectory_bytes"], "stream_bytes": best_ff["stream_bytes"],
            "mswea_trajectory_bytes": best_ms["trajectory_bytes"],
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "tokenizer": tokenizer}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``--steps``/``--repeats``/``--profile``, measure, print the JSON line; returns it as a dict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int_option(8, 1000), default=200)
    parser.add_argument("--repeats", type=int_option(1, 10), default=1)
    parser.add_argument("--profile", type=Path, default=None, help="cProfile output of forgeflow's first run")
    args = parser.parse_args(argv)
    agent = measure(args.steps, args.repeats, args.profile)
    result = {"agent": agent, "goals": {"overhead_max": 0.05, "overhead_ok": agent["overhead"] <= 0.05,
                                        "tokens_min": 100_000, "tokens_ok": agent["last_prompt_tokens"] >= 100_000}}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
