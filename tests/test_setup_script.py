"""scripts/setup.sh prints how long each step took and the total, also when a step fails; the llama.cpp
compile runs in the background and a failed step leaves no compile running.

Runs the real script in a copy of the repository's layout whose Python, helper scripts and dpkg are
stand-ins that only record their calls (nothing is installed or compiled)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["debian packages", "torch (cpu)", "harbor venv", "forgeflow dependencies", "llama.cpp compile",
         "  (waited for it)", "llama-cpp-python", "forgeflow [test]", "llama-server"]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, fail_on: str = "", compile_s: int = 0, fail_after_s: int = 0) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    _executable(tmp_path / "scripts" / "harbor_venv.sh", "echo harbor_venv >> \"$CALLS\"\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "dpkg-query", "#!/bin/sh\nprintf 'install ok installed'\n")
    _executable(bin_dir / "python", '#!/bin/bash\necho "python $*" >> "$CALLS"\n'
                                    '[ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]] && sleep "$FAIL_AFTER_S" && exit 3\n'
                                    '[[ "$*" == *--build-only* ]] && sleep "$COMPILE_S" && echo compiled >> "$CALLS"\n'
                                    'exit 0\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "CALLS": str(tmp_path / "calls.txt"), "FAIL_ON": fail_on, "COMPILE_S": str(compile_s),
           "FAIL_AFTER_S": str(fail_after_s)}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


def test_setup_prints_each_steps_time_and_the_total(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    took = re.findall(r"setup: step '(.+)' took (\d+\.\d) s", proc.stdout)
    assert [name for name, _ in took] == [name for name in STEPS if "waited" not in name]
    assert "setup: step 'llama.cpp compile' took" in proc.stdout and "(in the background; waited" in proc.stdout
    table = re.findall(r"setup:   (.+?) +(\d+\.\d)$", proc.stdout, re.MULTILINE)
    assert [name for name, _ in table] == [*STEPS, "total"]
    assert float(table[-1][1]) >= sum(float(s) for _, s in took) - 0.1 * len(took)  # rounding only
    calls = (tmp_path / "calls.txt").read_text()
    assert "scripts/llama_cpp_python.py --build-only" in calls and "ensure_llama_server" in calls
    # forgeflow's other dependencies are installed while llama.cpp compiles: every one but llama-cpp-python
    requirements = re.search(r"-r (\S+)", calls)
    assert requirements is not None and "-e .[test]" in calls


def test_forgeflow_dependencies_but_llama_cpp_python_are_listed_for_the_early_install(tmp_path: Path) -> None:
    """The snippet setup.sh runs to list forgeflow's requirements without llama-cpp-python (pip would
    compile it from the sdist while the shared build is still running)."""
    import sys
    import tomllib

    script = (ROOT / "scripts" / "setup.sh").read_text()
    snippet = script.split("<<'PYTHON'", 1)[1].split("\n", 1)[1].split("\nPYTHON\n", 1)[0]
    out = subprocess.run([sys.executable, "-"], input=snippet, capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    assert [r for r in wanted if r.replace(" ", "") not in out] == ["llama_cpp_python[server]==0.3.36"]


def test_a_failed_compile_fails_the_setup_when_it_is_waited_for(tmp_path: Path) -> None:
    proc = _run(tmp_path, fail_on="--build-only")
    assert proc.returncode == 3
    assert "setup: timings (s) until a step failed with exit 3:" in proc.stdout
    table = re.findall(r"setup:   (.+?) +(\d+\.\d)$", proc.stdout, re.MULTILINE)
    assert [name for name, _ in table] == [*STEPS[:6], "total"]
    assert "-e .[test]" not in (tmp_path / "calls.txt").read_text()  # nothing after the wait ran


def test_a_failing_step_stops_the_background_compile_and_prints_the_timings_so_far(tmp_path: Path) -> None:
    proc = _run(tmp_path, fail_on="torch==", compile_s=5, fail_after_s=1)
    assert proc.returncode == 3
    assert "setup: timings (s) until a step failed with exit 3:" in proc.stdout
    table = re.findall(r"setup:   (.+?) +(\d+\.\d)$", proc.stdout, re.MULTILINE)
    assert [name for name, _ in table] == [STEPS[0], "total"] and float(table[-1][1]) < 5
    time.sleep(6)  # the compile would have finished by now had it been left running
    calls = (tmp_path / "calls.txt").read_text()
    assert "--build-only" in calls and "compiled" not in calls and "harbor_venv" not in calls
