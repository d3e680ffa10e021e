"""Registry-stage benchmarks: layout plan at 50k tasks, skopeo wrapper overhead, prewarm speedup.

Run ``python -m benchmarks.registry``. It starts two loopback ``docker-registry`` servers
(127.0.0.1:5740 source, 127.0.0.1:5741 target) in a temporary folder, stops them by PID at the
end, prints one human line per figure and, as the last line, one JSON object::

    {"plan_50k_s": ..., "copy_overhead_ratio": ..., "prewarm_parallel_speedup": ..., ...}

Figures (and their targets):

* ``plan_50k_s``: :meth:`forgeflow.registry.layout.ShardLayout.plan` + ``check`` for 50,000 tasks on 500
  bases over 80 shards (5 lanes), wall seconds, the fastest of 3 runs (target < 1 s); beside it
  ``plan_50k_cpu_s``, the process CPU seconds of the fastest run (what the plan costs when other
  processes do not share the cores), and ``load_average_1min`` at the end.
* ``copy_overhead_ratio``: wall time of :meth:`forgeflow.registry.skopeo.Skopeo.copy` over 12 images of
  ``--sized-mb`` MiB of random data (default 16, smaller than any real environment image)
  divided by the wall time of the same ``skopeo copy`` command lines run by a plain
  ``subprocess.run`` loop (target <= 1.05). The two are interleaved image by image, alternating
  which goes first, so load from other processes hits both alike; every copy moves its own
  layer (no blob of the other contestant is reused). ``copy_overhead_median_ratio`` is the median
  of the per-copy ratios (one slow copy moves it less).
  ``copy_overhead_ratio_flow_process`` is the same measure once the flows are imported, as in a
  flow-run process (``flow_process_rss_mb``, ~130 MB here): a process started with ``fork`` costs more
  the more memory the parent holds (20-27 ms there, measured), which is why
  :meth:`forgeflow.registry.skopeo.Skopeo._run` uses ``subprocess.run`` (``vfork``, 0.6 ms flat) and no
  longer the ``sh`` package. ``copy_overhead_ratio_tiny`` is the same measure on N tiny images
  (one ~100-byte layer), where the copy is little more than skopeo's start.
* ``prewarm_parallel_speedup``: :func:`forgeflow.registry.prewarm.prewarm_basecache` of one basecache tag
  into each of the 80 shard repositories, ``max_workers=1`` time / ``max_workers=5`` time
  (target >= 2), against a registry ``--registry-latency-ms`` away (default 10 ms added to every
  HTTP request by a loopback proxy, :class:`tests.faultproxy.FaultProxy`: a registry in the same
  cloud region, whose manifest/blob requests take tens of ms). Concurrency exists to overlap
  those waits. ``prewarm_parallel_speedup_loopback`` is the same with no added latency: on a
  2-core machine the loopback registry and skopeo then share the cores and their CPU time per
  copy (~45 ms registry + skopeo, about the serial wall time per copy) bounds the speedup below
  2x whatever the concurrency. ``prewarm_parallel_speedup_flow_process`` (and its serial and
  parallel seconds) is the networked measure once the flows are imported, as the prewarm stage
  runs in a flow run. Bases are chosen so the 5 lanes of 16 bases cover all 80 repositories
  exactly once.

Images are written directly as OCI image layouts (one gzip layer holding one small file), so no
podman is needed and their digests are known before the push.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.options import int_option, number_option
from forgeflow.common.errors import ForgeflowError, InputError, ServerStartError
from forgeflow.common.settings import tool_env
from forgeflow.registry.layout import ShardLayout
from forgeflow.registry.prewarm import prewarm_basecache, verify_prewarm
from forgeflow.registry.server import RegistryServer
from forgeflow.registry.skopeo import Skopeo
from tests.faultproxy import FaultProxy

SOURCE_PORT, TARGET_PORT, LATENCY_PROXY_PORT = 5740, 5741, 5742
SIZED_PAIRS = 12
PLAN_TASKS, PLAN_BASES, PLAN_SHARDS, PLAN_LANES = 50_000, 500, 80, 5
PLAN_REPEATS = 3
MAX_REGISTRY_LATENCY_MS = 10_000.0
"""Upper bound of ``--registry-latency-ms`` (10 s per request is no registry, only a stall)."""
MAX_SHARDS = 10_000
"""Upper bound of ``--shards`` (:class:`forgeflow.registry.layout.ShardLayout` accepts no more)."""
PLAN_TAG_CAP = 1_000
"""50,000 tasks over 80 shards is ~625 task tags per repository: the default cap of 100 would
reject the plan, so the benchmark plans with a cap that fits (rejection costs the same)."""

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _go_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


class OCILayout:
    """A writable OCI image layout folder holding tiny single-layer images (one file each)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.entries: list[dict[str, object]] = []

    def _blob(self, data: bytes) -> str:
        digest = _sha(data)
        (self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
        return digest

    @staticmethod
    def manifest_for(content: bytes) -> tuple[bytes, bytes, bytes]:
        """(gzip layer, config, manifest) bytes of an image holding ``/data.txt`` = content."""
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo("data.txt")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        layer = gzip.compress(raw.getvalue(), mtime=0)
        config = json.dumps(
            {
                "architecture": _go_arch(),
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": [_sha(raw.getvalue())]},
            },
            sort_keys=True,
        ).encode()
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": _OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": _sha(config),
                    "size": len(config),
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": _sha(layer),
                        "size": len(layer),
                    }
                ],
            },
            sort_keys=True,
        ).encode()
        return layer, config, manifest

    def add(self, name: str, content: bytes) -> str:
        """Add image ``name`` holding ``content``; return its manifest digest."""
        layer, config, manifest = self.manifest_for(content)
        self._blob(layer)
        self._blob(config)
        digest = self._blob(manifest)
        self.entries.append(
            {
                "mediaType": _OCI_MANIFEST,
                "digest": digest,
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": name},
            }
        )
        (self.root / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "manifests": self.entries})
        )
        return digest

    def ref(self, name: str) -> str:
        """skopeo reference of image ``name`` in this layout."""
        return f"oci:{self.root}:{name}"


def bench_plan() -> tuple[float, dict[str, int]]:
    """Seconds for plan + check of 50k tasks (fastest of ``PLAN_REPEATS`` runs); and a few facts
    about the plan."""
    bases = [_sha(f"base-{i}".encode()) for i in range(PLAN_BASES)]
    tasks = [(f"owner{i % 997}__repo.{i:06d}.func_pm_x__{i}", bases[i % PLAN_BASES]) for i in range(PLAN_TASKS)]
    layout = ShardLayout(shards=PLAN_SHARDS, lanes=PLAN_LANES, tag_cap=PLAN_TAG_CAP)
    runs, cpu_runs = [], []
    for _ in range(PLAN_REPEATS):  # the fastest of a few: other processes share this machine's cores
        started, cpu_started = time.perf_counter(), time.process_time()
        plan = layout.plan(tasks).check()
        runs.append(time.perf_counter() - started)
        cpu_runs.append(time.process_time() - cpu_started)
    elapsed = min(runs)
    counts = plan.projected_tag_counts.values()
    return elapsed, {
        "cpu_s": round(min(cpu_runs), 4),
        "repositories": len(plan.projected_tag_counts),
        "basecache_tags": plan.basecache_tag_count,
        "max_tags_per_repository": max(counts),
    }


def _plain_copy_args(skopeo: Skopeo, src: str, dst: str, digestfile: Path) -> list[str]:
    """The exact command line :meth:`Skopeo.copy` runs (``--all --preserve-digests``)."""
    return skopeo.argv(
        "copy",
        "--quiet",
        f"--retry-times={skopeo.retry_times}",
        f"--digestfile={digestfile}",
        "--src-tls-verify=false",
        "--dest-tls-verify=false",
        "--all",
        "--preserve-digests",
        src,
        dst,
    )


def bench_copy_overhead(skopeo: Skopeo, sources: list[tuple[str, str]], target: str, scratch: Path, rounds: int,
                        repo_prefix: str = "overhead") -> dict[str, float]:
    """Interleaved forgeflow vs plain-loop copies into fresh target tags.

    ``sources`` holds (source for :meth:`Skopeo.copy`, source for the plain loop) pairs: the same
    image twice, or two images of the same size so that neither contestant finds the other's
    layers already in the target registry."""
    scratch.mkdir(parents=True, exist_ok=True)
    wrapper_s: list[float] = []
    plain_s: list[float] = []
    for round_index in range(rounds):
        for index, (src, plain_src) in enumerate(sources):
            ff_dst = f"docker://{target}/{repo_prefix}-ff/img-{index}:r{round_index}"
            plain_dst = f"docker://{target}/{repo_prefix}-plain/img-{index}:r{round_index}"

            def run_wrapper() -> None:
                started = time.perf_counter()
                skopeo.copy(src, ff_dst)
                wrapper_s.append(time.perf_counter() - started)

            def run_plain() -> None:
                digestfile = scratch / f"digest-{round_index}-{index}"
                started = time.perf_counter()
                subprocess.run(
                    _plain_copy_args(skopeo, plain_src, plain_dst, digestfile),
                    env=tool_env(),
                    check=True,
                    capture_output=True,
                    timeout=skopeo.command_timeout_s + 30,
                )
                digestfile.read_text()
                plain_s.append(time.perf_counter() - started)

            first, second = (run_wrapper, run_plain) if (index + round_index) % 2 else (run_plain, run_wrapper)
            first()
            second()
    return {
        "copies_each": len(wrapper_s),
        "wrapper_s": sum(wrapper_s),
        "plain_s": sum(plain_s),
        "ratio": sum(wrapper_s) / sum(plain_s),
        "median_ratio": statistics.median(w / p for w, p in zip(wrapper_s, plain_s)),
    }


def _covering_bases(layout: OCILayout, shards: int, lanes: int, run: str) -> dict[str, str]:
    """Add bases whose primary shards are 0, lanes, 2*lanes, ...: their lanes cover every shard
    exactly once. Returns base digest -> image name in ``layout``."""
    wanted = set(range(0, shards, lanes))
    chosen: dict[str, str] = {}
    attempt = 0
    while wanted:
        content = f"base {run} {attempt}\n".encode() * 8
        _, _, manifest = OCILayout.manifest_for(content)
        primary = int(hashlib.sha256(manifest).hexdigest()[:8], 16) % shards
        if primary in wanted:
            wanted.discard(primary)
            name = f"base-{run}-{primary:02d}"
            digest = layout.add(name, content)
            chosen[digest] = name
        attempt += 1
    return chosen


def bench_prewarm(skopeo: Skopeo, oci: OCILayout, target: str, shards: int, lanes: int, run: str) -> dict[str, float]:
    """Prewarm one basecache tag into each of ``shards`` repositories (registry ``target``,
    ``host:port``), 1 worker vs 5; ``run`` makes the bases and repository names unique."""
    names = _covering_bases(oci, shards, lanes, run)
    base_refs = {}
    for digest, name in names.items():
        ref = f"docker://{target}/bases/{name}:1"
        written = skopeo.copy(oci.ref(name), ref)
        assert written == digest, (written, digest)
        base_refs[digest] = ref
    tasks = []
    for digest, name in names.items():  # task ids until every lane of this base has one
        lanes_seen: set[int] = set()
        index = 0
        while len(lanes_seen) < lanes:
            task_id = f"task-{name}-{index}"
            lane = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % lanes
            if lane not in lanes_seen:
                lanes_seen.add(lane)
                tasks.append((task_id, digest))
            index += 1
    results: dict[str, float] = {}
    for label, workers in (("serial", 1), ("parallel", 5)):
        layout = ShardLayout(shards=shards, lanes=lanes, prefix=f"{label}{run}", tag_cap=1000)
        plan = layout.plan(tasks).check()
        started = time.perf_counter()
        records = prewarm_basecache(skopeo, plan, target, base_refs, max_workers=workers)
        results[f"{label}_s"] = time.perf_counter() - started
        if not all(record.copied for record in records):
            raise RuntimeError(f"{label} prewarm found tags already present; the timing is invalid")
        verify_prewarm(skopeo, records)
        results["tags"] = len(records)
        results["repositories"] = len(plan.basecache)
    results["speedup"] = results["serial_s"] / results["parallel_s"]
    return results


def _check_ports_free(ports: tuple[int, ...]) -> None:
    """Fail fast when a port the benchmark serves on is already taken on 127.0.0.1.

    Raises:
        ServerStartError: a port is bound by another process (e.g. a registry left running).
    """
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                raise ServerStartError(
                    f"port {port} on 127.0.0.1 is already in use ({exc.strerror}); the benchmark "
                    f"needs ports {', '.join(map(str, ports))} free (a registry left running?)"
                ) from None


def _raise_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM handler: ignore further SIGTERMs and unwind like Ctrl-C (``finally`` blocks stop the
    registries by PID and remove the temporary folder)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the three benchmarks; print human lines then one JSON line. Returns the JSON dict.

    Bad arguments exit 2 with one argparse-style line naming the option and value, before any
    work. A forgeflow error (busy port, missing ``docker-registry``) prints one ``error: ...``
    line and exits 2 for :class:`~forgeflow.common.errors.InputError`, 1 otherwise. SIGTERM unwinds like
    Ctrl-C: the registries are stopped by PID and the temporary folder is removed (exit 143).
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.registry",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int_option(1, 1_000), default=12,
                        help="tiny images for the copy overhead (1-1000)")
    parser.add_argument("--rounds", type=int_option(1, 1_000), default=3,
                        help="copy-overhead rounds over the images (1-1000)")
    parser.add_argument("--shards", type=int_option(1, MAX_SHARDS), default=80,
                        help=f"shard repositories to prewarm (1-{MAX_SHARDS})")
    parser.add_argument("--lanes", type=int_option(1, MAX_SHARDS), default=5,
                        help="lanes per base (1 to --shards)")
    parser.add_argument("--sized-mb", type=int_option(1, 1_024), default=16,
                        help="MiB of random data in each of the 24 images of the copy overhead "
                             "(12 per contestant; 1-1024)")
    parser.add_argument("--registry-latency-ms", type=number_option(0, MAX_REGISTRY_LATENCY_MS, "ms"), default=10.0,
                        help="latency added to every registry request for the prewarm speedup "
                             f"(0-{MAX_REGISTRY_LATENCY_MS:g})")
    args = parser.parse_args(argv)
    if args.lanes > args.shards:
        parser.error(f"argument --lanes: must be <= --shards ({args.shards}), got {args.lanes}")

    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return _run(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ForgeflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rss_mb() -> float:
    """This process's resident memory in MB (``VmRSS`` of /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _run(args: argparse.Namespace) -> dict[str, float]:
    """The benchmarks of :func:`main` on parsed, checked arguments."""
    _check_ports_free((SOURCE_PORT, TARGET_PORT, LATENCY_PROXY_PORT))
    plan_s, plan_facts = bench_plan()
    print(
        f"layout+plan: {PLAN_TASKS} tasks, {PLAN_BASES} bases over {PLAN_SHARDS} shards x "
        f"{PLAN_LANES} lanes: {plan_s:.3f} s wall, {plan_facts['cpu_s']:.3f} s CPU "
        f"({plan_facts['basecache_tags']} basecache tags, "
        f"max {plan_facts['max_tags_per_repository']} tags in one repository, cap {PLAN_TAG_CAP})",
        flush=True,
    )

    run = hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:6]
    skopeo = Skopeo(retry_times=3, command_timeout_s=120)
    with tempfile.TemporaryDirectory(prefix="forgeflow-bench-") as tmp:
        root = Path(tmp)
        source = RegistryServer("bench-source", SOURCE_PORT, root / "source" / "storage")
        target = RegistryServer("bench-target", TARGET_PORT, root / "target" / "storage")
        try:
            source.start()
            target.start()
            oci = OCILayout(root / "oci")
            sources = []
            for index in range(args.images):
                name = f"img-{index}"
                oci.add(name, f"tiny image {run} {index}\n".encode() * 4)
                ref = f"docker://{source.address}/bench/{name}:1"
                skopeo.copy(oci.ref(name), ref)
                sources.append(ref)
            tiny = bench_copy_overhead(skopeo, [(src, src) for src in sources], target.address, root, args.rounds)
            print(
                f"copy overhead on tiny images: {tiny['copies_each']} copies each; forgeflow Skopeo.copy "
                f"{tiny['wrapper_s']:.2f} s vs plain subprocess loop {tiny['plain_s']:.2f} s: "
                f"ratio {tiny['ratio']:.3f} (median per-copy ratio {tiny['median_ratio']:.3f})",
                flush=True,
            )
            def sized_overhead(label: str) -> dict[str, float]:
                sources = []
                for index in range(2 * SIZED_PAIRS):  # every copy moves its own layer: no blob is reused
                    name = f"{label}-{index}"
                    oci.add(name, os.urandom(args.sized_mb << 20))
                    ref = f"docker://{source.address}/bench/{name}:1"
                    skopeo.copy(oci.ref(name), ref)
                    sources.append(ref)
                return bench_copy_overhead(skopeo, list(zip(sources[::2], sources[1::2], strict=True)),
                                           target.address, root / label, 1, label)

            sized = sized_overhead("sized")
            print(
                f"copy overhead on {args.sized_mb} MiB images: {sized['copies_each']} copies each; "
                f"Skopeo.copy {sized['wrapper_s']:.2f} s vs plain loop {sized['plain_s']:.2f} s: "
                f"ratio {sized['ratio']:.3f} (median per-copy ratio {sized['median_ratio']:.3f})",
                flush=True,
            )
            note = "" if args.shards == 80 else f" (reduced from 80 shards to {args.shards})"
            loopback = bench_prewarm(skopeo, oci, target.address, args.shards, args.lanes, run)
            print(
                f"prewarm, loopback registry (no added latency): {loopback['tags']:.0f} basecache tags into "
                f"{loopback['repositories']:.0f} shard repositories{note}: max_workers=1 "
                f"{loopback['serial_s']:.2f} s, max_workers=5 {loopback['parallel_s']:.2f} s: "
                f"speedup {loopback['speedup']:.2f}x",
                flush=True,
            )
            def networked_prewarm(suffix: str) -> dict[str, float]:
                with FaultProxy(LATENCY_PROXY_PORT, target.address, delay_s=args.registry_latency_ms / 1000) as proxy:
                    return bench_prewarm(skopeo, oci, proxy.address, args.shards, args.lanes, run + suffix)

            prewarm = networked_prewarm("l")
            print(
                f"prewarm, registry {args.registry_latency_ms:g} ms away: max_workers=1 {prewarm['serial_s']:.2f} s, "
                f"max_workers=5 {prewarm['parallel_s']:.2f} s: speedup {prewarm['speedup']:.2f}x",
                flush=True,
            )
            # the same measures in a process the size of a flow run (the flows imported): a command
            # started by fork would cost more there (fork time grows with resident memory)
            import flows.lifecycle  # noqa: F401,PLC0415
            flow_rss_mb = _rss_mb()
            in_flow = sized_overhead("flowproc")
            print(
                f"copy overhead on {args.sized_mb} MiB images in a flow-run-sized process ({flow_rss_mb:.0f} MB "
                f"resident): Skopeo.copy {in_flow['wrapper_s']:.2f} s vs plain loop {in_flow['plain_s']:.2f} s: "
                f"ratio {in_flow['ratio']:.3f} (median per-copy ratio {in_flow['median_ratio']:.3f})",
                flush=True,
            )
            flow_prewarm = networked_prewarm("f")
            print(
                f"prewarm in that process, registry {args.registry_latency_ms:g} ms away: max_workers=1 "
                f"{flow_prewarm['serial_s']:.2f} s, max_workers=5 {flow_prewarm['parallel_s']:.2f} s: "
                f"speedup {flow_prewarm['speedup']:.2f}x",
                flush=True,
            )
        finally:
            target.stop()
            source.stop()

    result = {
        "plan_50k_s": round(plan_s, 4),
        "plan_50k_cpu_s": plan_facts["cpu_s"],
        "load_average_1min": round(os.getloadavg()[0], 2),
        "copy_overhead_ratio": round(sized["ratio"], 4),
        "copy_overhead_median_ratio": round(sized["median_ratio"], 4),
        "copy_overhead_image_mb": args.sized_mb,
        "copy_overhead_ratio_flow_process": round(in_flow["ratio"], 4),
        "copy_overhead_median_ratio_flow_process": round(in_flow["median_ratio"], 4),
        "flow_process_rss_mb": round(flow_rss_mb),
        "copy_overhead_ratio_tiny": round(tiny["ratio"], 4),
        "copy_overhead_median_ratio_tiny": round(tiny["median_ratio"], 4),
        "copies_each_tiny": tiny["copies_each"],
        "prewarm_parallel_speedup": round(prewarm["speedup"], 3),
        "prewarm_registry_latency_ms": args.registry_latency_ms,
        "prewarm_serial_s": round(prewarm["serial_s"], 3),
        "prewarm_parallel_s": round(prewarm["parallel_s"], 3),
        "prewarm_parallel_speedup_loopback": round(loopback["speedup"], 3),
        "prewarm_parallel_speedup_flow_process": round(flow_prewarm["speedup"], 3),
        "prewarm_serial_s_flow_process": round(flow_prewarm["serial_s"], 3),
        "prewarm_parallel_s_flow_process": round(flow_prewarm["parallel_s"], 3),
        "prewarm_shards": args.shards,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
