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
