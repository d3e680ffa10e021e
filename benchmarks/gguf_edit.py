"""Benchmark: a header-growing GGUF metadata edit (streaming path) vs ``cp`` of the same file.

``python -m benchmarks.gguf_edit [--size-gb 2] [--dir /tmp]`` writes a synthetic GGUF of about
``--size-gb`` GB (gguf-py ``GGUFWriter``; F32 tensors of 256 MiB with random values, written one
at a time so the writer's memory stays at one tensor), then

* times ``cp`` of the file (coreutils; ext4 copies in the kernel with ``copy_file_range``);
* runs :func:`forgeflow.gguf_edit.set_metadata` growing ``general.name`` by 4 KiB (so the data
  section moves: the streaming path) in a child process, twice: with sha256 verification of
  every tensor (the default) and without; peak RSS is the child's ``VmHWM`` from
  ``/proc/self/status`` (``ru_maxrss`` of children is printed too, but it can include pages
  shared with this parent before ``exec``); edit times are the child's wall time, interpreter
  start included;

prints human lines, then as the last line one JSON object: ``file_gb``, ``peak_rss_mb``,
``time_vs_cp`` (the default, verified edit), ``time_vs_cp_unverified``, ``edit_s``, ``cp_s`` and
the targets (<= 256 MB, <= 1.2x cp). The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_TENSOR_BYTES = 256 << 20
_CHILD = """
import json, sys
from forgeflow.gguf_edit import set_metadata
r = set_metadata(sys.argv[1], "general.name", "n" * 4096, out_path=sys.argv[2],
                 verify=sys.argv[3] == "1")
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"in_place": r.in_place, "duration_s": r.duration_s,
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


def _run_edit(src: Path, dst: Path, verify: bool) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst), "1" if verify else "0"],
        capture_output=True, text=True, check=True,
    )
    wall = time.perf_counter() - started
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON summary it printed last."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_edit")
    parser.add_argument("--size-gb", type=float, default=2.0, help="synthetic file size (GB)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    if args.size_gb <= 0:
        parser.error("--size-gb must be > 0")
    size = int(args.size_gb * 1e9)
    free = shutil.disk_usage(args.dir).free
    if free < 3.2 * size:
        raise SystemExit(f"{args.dir} has {free / 1e9:.1f} GB free; need {3.2 * size / 1e9:.1f} GB")
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="forgeflow-gguf-edit-bench."))
    try:
        src = work / "synthetic.gguf"
        t = time.perf_counter()
        file_bytes = write_synthetic_gguf(src, size)
        print(f"synthetic GGUF: {file_bytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
        # warm the page cache evenly for both contestants: one cp first (not timed)
        subprocess.run(["cp", str(src), str(work / "warm.gguf")], check=True)
        (work / "warm.gguf").unlink()
        edit_s, edit = _run_edit(src, work / "edited.gguf", verify=True)
        (work / "edited.gguf").unlink()
        fast_s, fast = _run_edit(src, work / "edited-unverified.gguf", verify=False)
        (work / "edited-unverified.gguf").unlink()
        # VmHWM of the child itself: ru_maxrss of children can include pages the child shared
        # with this parent before exec (the parent held a 256 MiB tensor while writing).
        peak_rss_mb = max(edit["vm_hwm_kb"], fast["vm_hwm_kb"]) / 1024
        rusage_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        t = time.perf_counter()
        subprocess.run(["cp", str(src), str(work / "copy.gguf")], check=True)
        cp_s = time.perf_counter() - t
        t = time.perf_counter()  # cp plus fsync of the copy: the durability set_metadata gives
        subprocess.run(["cp", str(src), str(work / "copy2.gguf")], check=True)
        subprocess.run(["sync", str(work / "copy2.gguf")], check=True)
        cp_sync_s = time.perf_counter() - t
        print(f"edit (streaming, sha256-verified {edit['tensors_verified']} tensors): "
              f"{edit_s:.2f} s wall (in_place={edit['in_place']})")
        print(f"edit (streaming, unverified): {fast_s:.2f} s wall")
        print(f"cp: {cp_s:.2f} s; cp + sync of the copy: {cp_sync_s:.2f} s; peak RSS of the edit processes: {peak_rss_mb:.0f} MB (VmHWM; "
              f"ru_maxrss of children {rusage_mb:.0f} MB)")
        print(f"edit operation alone (EditResult.duration_s, no interpreter start): verified "
              f"{edit['duration_s']:.2f} s, unverified {fast['duration_s']:.2f} s")
        summary = {
            "file_gb": round(file_bytes / 1e9, 3),
            "peak_rss_mb": round(peak_rss_mb, 1),
            "time_vs_cp": round(edit_s / cp_s, 2),
            "time_vs_cp_unverified": round(fast_s / cp_s, 2),
            "edit_s": round(edit_s, 2),
            "edit_unverified_s": round(fast_s, 2),
            "cp_s": round(cp_s, 2),
            "cp_sync_s": round(cp_sync_s, 2),
            "time_vs_cp_sync_unverified": round(fast_s / cp_sync_s, 2),
            "edit_op_s": round(edit["duration_s"], 2),
            "edit_op_unverified_s": round(fast["duration_s"], 2),
            "target_peak_rss_mb": 256,
            "target_time_vs_cp": 1.2,
        }
        print(json.dumps(summary))
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
