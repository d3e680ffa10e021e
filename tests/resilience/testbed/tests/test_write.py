"""Runs INSIDE a sandbox: a task that writes outside its workdir and tries to mount."""

import os
import pathlib
import subprocess


def test_overwrite_host_path():
    target = pathlib.Path(os.environ["FF_HOST_FILE"])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("written by the sandbox\n")
    assert target.read_text() == "written by the sandbox\n"


def test_write_system_file():
    pathlib.Path("/etc/ff-escape").write_text("x\n")
    pathlib.Path("/usr/bin/python3").unlink()
    assert not pathlib.Path("/usr/bin/python3").exists()


def test_mount_host_filesystem():
    subprocess.run(["mount", "-t", "tmpfs", "none", "/mnt"], check=True, capture_output=True)
