"""Benchmark: a header-growing GGUF metadata edit (a streamed new file) vs ``cp`` of the same file.

``python -m benchmarks.gguf_edit [--size-gb 2] [--dir /tmp] [--repeats 3]`` writes a synthetic
GGUF of about ``--size-gb`` GB (gguf-py ``GGUFWriter``; F32 tensors of 256 MiB with random values,
written one at a time so the writer's memory stays at one tensor), warms the page cache with one
untimed ``cp``, then ``--repeats`` rounds of, each after an untimed ``sync`` and with the
previous output deleted:

* ``cp`` of the file followed by ``sync FILE`` (fsync of the copy): the baseline.
  :func:`forgeflow.packaging.gguf_metadata.apply_metadata_edits` fsyncs the new file before its
  atomic rename, so the fair comparison is a copy that is just as durable; a bare ``cp`` returns
  while the data is still dirty in the page cache;
* bare ``cp`` (coreutils; ext4 copies in the kernel with ``copy_file_range``), for reference;
* :func:`~forgeflow.packaging.gguf_metadata.apply_metadata_edits` with one ``set`` growing
  ``general.name`` by 4 KiB (so the data section moves) in a child process,
  three times: default verification
  (``"sampled"``), ``verify="full"`` (sha256 of every tensor, source and result) and
  ``verify="none"``, in an order rotated each round (round 1 sampled/full/none, round 2
  full/none/sampled, ...), so no mode always runs first after the ``cp`` runs or after the same
  other edit (the page cache and the disk's queue carry over from one run to the next). Edit
  times are the child's wall time, interpreter start included. Peak RSS is the largest
  ``VmHWM`` (``/proc/self/status``) of the edit children (``ru_maxrss`` of children is printed
  too, but it can include pages shared with this parent before ``exec``).

Times are medians over the rounds (seconds). Prints human lines, then as the last line one JSON
object: ``file_gb``; ``peak_rss_mb``; ``time_vs_cp`` (default edit / (``cp`` + ``sync FILE``));
``time_vs_bare_cp`` (default edit / bare ``cp``); ``time_vs_cp_full_verify`` and
``time_vs_cp_unverified`` (those edits / (``cp`` + ``sync FILE``)); the medians ``edit_s``,
``edit_full_verify_s``, ``edit_unverified_s``, ``edit_op_s`` (``MetadataEditResult.duration_s`` of the
default edit: no interpreter start), ``cp_s``, ``cp_sync_s``; ``repeats``; ``time_vs_cp_baseline``
(a reminder of the denominator) and the targets (<= 256 MB, <= 1.2x). The files are deleted at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.options import int_option, number_option

_TENSOR_BYTES = 256 << 20
_CHILD = """
import json, sys
from forgeflow.packaging.gguf_metadata import MetadataEdit, apply_metadata_edits
r = apply_metadata_edits(sys.argv[1], [MetadataEdit(op="set", key="general.name", value="n" * 4096)],
                         out_path=sys.argv[2], verify=sys.argv[3])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"duration_s": r.duration_s,
                  "verification": r.verification,
                  "tensors_verified": r.tensors_verified, "vm_hwm_kb": int(hwm)}))
"""


def write_synthetic_gguf(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Write a GGUF of about ``size_bytes`` (F32 tensors of 256 MiB; the last one smaller).

    Returns:
        The file size in bytes.
    """
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("synthetic")
    writer.add_block_count(1)
    sizes = []
    left = size_bytes
    while left > 0:
        n = min(_TENSOR_BYTES, left)
        n -= n % (4 * 4096)
        if n <= 0:
            break
        sizes.append(n)
        left -= n
    for i, n in enumerate(sizes):
        writer.add_tensor_info(f"blk.{i}.ffn_up.weight", (n // 4 // 4096, 4096), np.dtype(np.float32), n)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for n in sizes:
        data = rng.random(n // 4, dtype=np.float32).reshape(n // 4 // 4096, 4096)
        writer.write_tensor_data(data)
        del data
    writer.close()
    return path.stat().st_size


def _run_edit(src: Path, dst: Path, verify: str) -> tuple[float, dict]:
    """One edit in a child process: (wall seconds, the child's JSON report); deletes ``dst``."""
    os.sync()  # untimed: earlier runs' dirty pages must not be flushed on this run's clock
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst), verify],
        capture_output=True, text=True, check=True,
    )
    wall = time.perf_counter() - started
    dst.unlink()
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def _run_cp(src: Path, dst: Path, fsync: bool) -> float:
    """Wall seconds of ``cp src dst`` (then ``sync dst`` when ``fsync``); deletes ``dst``."""
    os.sync()
    started = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    if fsync:
        subprocess.run(["sync", str(dst)], check=True)
    wall = time.perf_counter() - started
    dst.unlink()
    return wall


MIN_SIZE_GB, MAX_SIZE_GB = 0.001, 1_000.0
"""Bounds of ``--size-gb``: at least one tensor of data (1 MB); at most 1 TB (the benchmark
needs 3.2x the size free on ``--dir``)."""


def _work_dir(text: str) -> Path:
    """argparse ``type`` of ``--dir``: an existing directory this process may write into.

    Raises:
        argparse.ArgumentTypeError: it does not exist, is not a directory or is not writable.
    """
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"directory {text!r} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {text!r} is not writable")
    return path


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON summary it printed last.

    Bad arguments exit 2 with one argparse-style line naming the option and value, before any
    file is written; so does a ``--size-gb`` that does not fit the free space of ``--dir``.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_edit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=number_option(MIN_SIZE_GB, MAX_SIZE_GB, "GB"), default=2.0,
                        help=f"synthetic file size (GB, {MIN_SIZE_GB:g}-{MAX_SIZE_GB:g})")
    parser.add_argument("--dir", type=_work_dir, default=Path(tempfile.gettempdir()),
                        help="existing writable directory for the files (needs 3.2x --size-gb free)")
    parser.add_argument("--repeats", type=int_option(1, 100), default=3, help="rounds (1-100); times are medians")
    args = parser.parse_args(argv)
    size = int(args.size_gb * 1e9)
    free = shutil.disk_usage(args.dir).free
    if free < 3.2 * size:
        parser.error(f"argument --size-gb: {args.size_gb:g} GB needs {3.2 * size / 1e9:.1f} GB free in --dir "
                     f"{args.dir}, which has {free / 1e9:.1f} GB (use a smaller --size-gb or another --dir)")
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="forgeflow-gguf-edit-bench."))
    try:
        src = work / "synthetic.gguf"
        t = time.perf_counter()
        file_bytes = write_synthetic_gguf(src, size)
        print(f"synthetic GGUF: {file_bytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
        # warm the page cache evenly for all contestants: one cp first (not timed)
        subprocess.run(["cp", str(src), str(work / "warm.gguf")], check=True)
        (work / "warm.gguf").unlink()
        runs: dict[str, list[float]] = {k: [] for k in ("cp_sync", "cp", "sampled", "full", "none")}
        reports: list[dict] = []
        modes = ("sampled", "full", "none")
        for round_no in range(args.repeats):
            runs["cp_sync"].append(_run_cp(src, work / "copy.gguf", fsync=True))
            runs["cp"].append(_run_cp(src, work / "copy.gguf", fsync=False))
            first = round_no % len(modes)
            for mode in modes[first:] + modes[:first]:
                wall, report = _run_edit(src, work / f"edited-{mode}.gguf", mode)
                assert report["verification"] == mode, report
                runs[mode].append(wall)
                reports.append(report)
        med = {k: statistics.median(v) for k, v in runs.items()}
        edit_op_s = statistics.median(
            r["duration_s"] for r in reports if r["verification"] == "sampled")
        # VmHWM of the children themselves: ru_maxrss of children can include pages a child
        # shared with this parent before exec (the parent held a 256 MiB tensor while writing).
        peak_rss_mb = max(r["vm_hwm_kb"] for r in reports) / 1024
        rusage_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        n_tensors = reports[0]["tensors_verified"]
        print(f"medians of {args.repeats} rounds, seconds of wall time:")
        print(f"  cp + sync of the copy (the baseline: the edit fsyncs before its rename): "
              f"{med['cp_sync']:.2f} s; bare cp (returns with the copy still dirty in the page "
              f"cache): {med['cp']:.2f} s")
        print(f"  edit, default verification (sampled: header + first/middle/last 4 KiB of "
              f"{n_tensors} tensors): {med['sampled']:.2f} s (operation alone, no interpreter "
              f"start: {edit_op_s:.2f} s)")
        print(f"  edit, verify='full' (sha256 of every tensor, source and result): "
              f"{med['full']:.2f} s")
        print(f"  edit, verify='none': {med['none']:.2f} s")
        print(f"peak RSS of the edit processes: {peak_rss_mb:.0f} MB (VmHWM; ru_maxrss of "
              f"children {rusage_mb:.0f} MB)")
        print(f"time_vs_cp = default edit / (cp + sync FILE) = "
              f"{med['sampled'] / med['cp_sync']:.2f}; "
              f"vs bare cp {med['sampled'] / med['cp']:.2f}; full verification / (cp + sync FILE) "
              f"{med['full'] / med['cp_sync']:.2f}")
        summary = {
            "file_gb": round(file_bytes / 1e9, 3),
            "peak_rss_mb": round(peak_rss_mb, 1),
            "time_vs_cp": round(med["sampled"] / med["cp_sync"], 2),
            "time_vs_bare_cp": round(med["sampled"] / med["cp"], 2),
            "time_vs_cp_full_verify": round(med["full"] / med["cp_sync"], 2),
            "time_vs_cp_unverified": round(med["none"] / med["cp_sync"], 2),
            "time_vs_cp_baseline": "cp + sync FILE",
            "edit_s": round(med["sampled"], 2),
            "edit_full_verify_s": round(med["full"], 2),
            "edit_unverified_s": round(med["none"], 2),
            "edit_op_s": round(edit_op_s, 2),
            "cp_s": round(med["cp"], 2),
            "cp_sync_s": round(med["cp_sync"], 2),
            "repeats": args.repeats,
            "target_peak_rss_mb": 256,
            "target_time_vs_cp": 1.2,
        }
        print(json.dumps(summary))
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
