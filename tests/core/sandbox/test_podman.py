"""Which ``podman run`` failures mean "a container already holds this trial's name" (then the left
container is removed and the start tried again). Both wordings are podman 4.3's, the second copied
from a CI run where a Ray node was SIGKILLed mid-trial and its container was left half removed."""

from forgeflow.sandbox.podman import _name_in_use


def test_both_wordings_of_a_taken_name_are_recognised() -> None:
    assert _name_in_use('Error: creating container storage: the container name "ff-nop-x-1" is already in use by '
                        'abc123. You have to remove that container to be able to reuse that name.: that name is '
                        'already in use')
    assert _name_in_use('Error: name "ff-nop-inflection-func-pm-op-change-const-cg1hf8bl-231-a245c917" is in use: '
                        'container already exists')


def test_other_start_failures_are_not_a_taken_name() -> None:
    assert not _name_in_use("Error: localhost/forgeflow/task:x: image not known")
    assert not _name_in_use("Error: OCI runtime error: runc: container_linux.go: starting container process")


def test_every_container_drops_all_capabilities_gains_no_privilege_and_maps_root_away_from_host_root() -> None:
    from forgeflow.sandbox.base import SandboxSpec
    from forgeflow.sandbox.podman import PodmanSandbox

    args = PodmanSandbox("img", SandboxSpec(), name="ff-x")._hardening_args()
    assert args[:2] == ["--cap-drop=all", "--security-opt=no-new-privileges"]  # nothing added back
    assert args[args.index("--uidmap") + 1] == args[args.index("--gidmap") + 1] == "0:1879048192:65536"
    assert args[args.index("--annotation") + 1] == "dev.forgeflow.name=ff-x"
    assert "--read-only" not in args
    spec = SandboxSpec(capabilities=("CHOWN",), user_namespace="auto", read_only_root=True)
    args = PodmanSandbox("img", spec, name="ff-x")._hardening_args()
    assert "--cap-add=CHOWN" in args and "--userns=auto" in args and "--uidmap" not in args
    assert "--read-only" in args and "type=tmpfs,destination=/testbed,tmpfs-mode=0755,tmpcopyup" in args
    assert "--userns" not in " ".join(PodmanSandbox("img", SandboxSpec(user_namespace=None))._hardening_args())


def test_capabilities_that_reach_the_reporting_process_are_refused() -> None:
    import pytest
    from pydantic import ValidationError

    from forgeflow.sandbox.base import UNSAFE_CAPABILITIES, SandboxSpec

    for cap in UNSAFE_CAPABILITIES:
        with pytest.raises(ValidationError, match="would let a command reach"):
            SandboxSpec(capabilities=(cap,))
    with pytest.raises(ValidationError, match="without CAP_"):
        SandboxSpec(capabilities=("CAP_CHOWN",))


def test_a_command_that_floods_its_output_is_kept_to_the_bound_and_its_report_refused() -> None:
    """A flood of output (a submission's own, red-team run: 300 MiB took a scorer to 416 MB) is read and
    dropped past the bound, counted; the verifier then refuses to read such a run's report (an error the
    scorer attributes by a pristine re-run, never a pass)."""
    import pytest

    from forgeflow.common import errors
    from forgeflow.sandbox.base import ExecResult, run_bounded
    from forgeflow.sandbox.verifier import _common

    code, out, err, dropped = run_bounded(["bash", "-c", "head -c 3000000 /dev/zero; echo tail >&2; exit 3"],
                                          timeout_s=60, max_bytes=1 << 20)
    assert (code, len(out), err, dropped) == (3, 1 << 20, b"tail\n", 3000000 - (1 << 20))
    flooded = ExecResult.from_bytes(0, out, err, 1.0, dropped)
    with pytest.raises(errors.VerifierOutputError, match="output passed the 64 MiB kept per stream"):
        _common(flooded, "")
