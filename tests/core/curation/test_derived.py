"""Derived task sets: set algebra over named sources, errors, stored digests that detect change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.curation.derived import (
    SourceSet,
    derive,
    frozen_split_sets,
    id_list_set,
    ids_sha256,
    parse_definitions,
    store_images_available_set,
    store_status_set,
)
from forgeflow.curation.derived_store import read_derived, save_derived, verify_derived
from forgeflow.curation.freeze import (
    SplitQuotas,
    TaskRef,
    select_splits,
    write_freeze,
)
from forgeflow.ledger.records import ImageRecord, TaskRecord
from forgeflow.ledger.store import Store


def _explicit(name: str, ids: list[str]) -> SourceSet:
    return SourceSet(name=name, kind="explicit", ids=frozenset(ids))


STATIC = _explicit("static", ["a", "b", "c", "d", "e"])
VERIFIED = _explicit("verified_any", ["b", "c", "e", "z"])
IMAGES = _explicit("images_available", ["a", "b", "c"])


def test_union_intersection_difference_and_parentheses() -> None:
    sets = derive(
        """
        # comments and blank lines are allowed
        both = static & verified_any
        either = static | verified_any
        only_static = static - verified_any
        grouped = static - (verified_any & images_available)
        unicode = static ∩ verified_any ∖ images_available
        """,
        [STATIC, VERIFIED, IMAGES],
    )
    assert sets["both"].ids == ["b", "c", "e"]
    assert sets["either"].ids == ["a", "b", "c", "d", "e", "z"]
    assert sets["only_static"].ids == ["a", "d"]
    assert sets["grouped"].ids == ["a", "d", "e"]
    assert sets["unicode"].ids == ["e"]
    assert sets["both"].inputs["static"].ids_sha256 == ids_sha256(["e", "d", "c", "b", "a"])


def test_derived_sets_chain_and_record_their_leaf_inputs_and_definitions() -> None:
    sets = derive(
        {"freeze_pro": "filter_pro & images_available", "filter_pro": "static & verified_any"},
        [STATIC, VERIFIED, IMAGES],
    )
    assert sets["freeze_pro"].ids == ["b", "c"]
    assert set(sets["freeze_pro"].inputs) == {"static", "verified_any", "images_available"}
    assert sets["freeze_pro"].definitions == {
        "filter_pro": "static & verified_any",
        "freeze_pro": "filter_pro & images_available",
    }


def test_unknown_name_is_named_with_the_known_ones() -> None:
    with pytest.raises(
        InputError, match=r"refers to unknown set 'verifed_any'.*known sets: .*static"
    ):
        derive("x = static & verifed_any", [STATIC, VERIFIED])


def test_cycle_is_reported_with_its_path() -> None:
    with pytest.raises(
        InputError, match=r"cycle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"
    ):
        derive("a = b & static\nb = c | static\nc = a - static", [STATIC])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x = __import__('os').system('true')", "is not allowed"),
        ("x = static ^ verified_any", "is not allowed"),
        ("x = static & 3", "is not allowed"),
        ("x = static &", "does not parse"),
        ("static & verified_any", "expected 'name = expression'"),
        ("x = static\nx = verified_any", "defined twice"),
    ],
)
def test_bad_definitions_are_rejected_without_evaluation(text: str, expected: str) -> None:
    with pytest.raises(InputError, match=expected):
        parse_definitions(text)


def test_derived_name_may_not_shadow_a_source() -> None:
    with pytest.raises(InputError, match="name of a source set"):
        derive("static = verified_any", [STATIC, VERIFIED])


@pytest.fixture()
def store(store_url: str) -> Store:
    store = Store(store_url)
    store.upgrade()
    for n in range(12):
        repo = f"org/r{n:02d}"
        for i in range(3):
            instance_id = f"r{n:02d}-{i}"
            store.record_task(
                TaskRecord(
                    instance_id=instance_id,
                    repo=repo,
                    status="accepted" if i < 2 else "rejected",
                    image_ref=f"reg/task:{instance_id}",
                )
            )
            if n % 2 == 0:
                store.record_image(ImageRecord(ref=f"reg/task:{instance_id}", role="task"))
    yield store
    store.dispose()


@pytest.fixture()
def manifest(store: Store, tmp_path: Path) -> Path:
    accepted = [
        TaskRef(instance_id=t.instance_id, repo=t.repo) for t in store.accepted_tasks()
    ]
    quotas = SplitQuotas(train=8, validation=4, test=4, max_per_repo=2, min_repos=8)
    selection = select_splits(accepted, quotas, seed=1)
    assert selection.ready
    return write_freeze("d1", selection, quotas, 1, tmp_path / "freezes").path


def test_freeze_pro_over_store_freeze_and_images_with_per_split_counts(
    store: Store, manifest: Path, tmp_path: Path
) -> None:
    solved = tmp_path / "solved.txt"
    solved.write_text("\n".join(f"r{n:02d}-0" for n in range(12)) + "\nnot-in-store\n")
    sources = [
        store_status_set("static", store),
        id_list_set("verified_any", solved, source_revision="results@3f2a9c1"),
        store_images_available_set("images_available", store),
        *frozen_split_sets(manifest).values(),
    ]
    sets = derive(
        "filter_pro = static & verified_any\n"
        "freeze_pro = filter_pro & frozen & images_available\n"
        "freeze_pro_test = filter_pro & frozen.test & images_available\n",
        sources,
    )
    freeze = json.loads(manifest.read_text())
    even_solved = {f"r{n:02d}-0" for n in range(0, 12, 2)}
    assert sets["filter_pro"].ids == sorted(f"r{n:02d}-0" for n in range(12))
    assert set(sets["freeze_pro"].ids) == even_solved
    counts = sets["freeze_pro"].split_counts["d1"]
    assert counts == {s: len(even_solved & set(freeze["splits"][s])) for s in freeze["splits"]}
    assert sum(counts.values()) == len(even_solved)
    assert sets["freeze_pro_test"].ids == sorted(even_solved & set(freeze["splits"]["test"]))

    path = save_derived(sets["freeze_pro"], tmp_path / "derived").path
    assert verify_derived(path, store=store).ids == sets["freeze_pro"].ids
    recorded = read_derived(path)
    assert recorded.inputs["verified_any"].provenance["source_revision"] == "results@3f2a9c1"

    # A changed input is detected and named: one more rejected task becomes accepted.
    store.record_task(
        TaskRecord(
            instance_id="r00-2", repo="org/r00", status="accepted", image_ref="reg/task:r00-2"
        )
    )
    with pytest.raises(
        InputError, match=r"inputs changed: 'static' \(store_status\): recorded 24 ids"
    ):
        verify_derived(path, store=store)


def test_changed_id_list_file_is_detected(store: Store, tmp_path: Path) -> None:
    solved = tmp_path / "solved.json"
    solved.write_text(json.dumps(["r00-0", "r01-0"]))
    sets = derive(
        "x = static & solved",
        [store_status_set("static", store), id_list_set("solved", solved, "v1")],
    )
    path = save_derived(sets["x"], tmp_path).path
    assert verify_derived(path, store=store).ids == ["r00-0", "r01-0"]
    solved.write_text(json.dumps(["r00-0"]))
    with pytest.raises(InputError, match=r"'solved' \(id_list\): recorded 2 ids"):
        verify_derived(path, store=store)


def test_explicit_inputs_must_be_supplied_and_are_checked(tmp_path: Path) -> None:
    path = save_derived(derive("x = static - verified_any", [STATIC, VERIFIED])["x"], tmp_path).path
    with pytest.raises(InputError, match="explicit set: pass it in inputs="):
        verify_derived(path)
    assert verify_derived(path, inputs=[STATIC, VERIFIED]).ids == ["a", "d"]
    with pytest.raises(InputError, match="'verified_any'"):
        verify_derived(path, inputs=[STATIC, _explicit("verified_any", ["a"])])


def test_hand_edited_file_is_detected(tmp_path: Path) -> None:
    path = save_derived(derive("x = static & verified_any", [STATIC, VERIFIED])["x"], tmp_path).path
    document = json.loads(path.read_text())
    document["ids"].append("injected")
    path.write_text(json.dumps(document))
    with pytest.raises(InputError, match="was altered"):
        verify_derived(path, inputs=[STATIC, VERIFIED])


def test_altered_freeze_manifest_input_is_rejected(
    store: Store, manifest: Path, tmp_path: Path
) -> None:
    sets = derive(
        "x = static & frozen.train",
        [store_status_set("static", store), *frozen_split_sets(manifest).values()],
    )
    path = save_derived(sets["x"], tmp_path / "derived").path
    assert verify_derived(path, store=store).count == sets["x"].count > 0
    document = json.loads(manifest.read_text())
    document["splits"]["train"] = document["splits"]["train"][1:]
    manifest.write_text(json.dumps(document))
    with pytest.raises(InputError, match="was altered"):
        verify_derived(path, store=store)


def test_id_list_needs_a_pinned_revision() -> None:
    with pytest.raises(InputError, match="source_revision"):
        id_list_set("solved", ["a"], source_revision=" ")


def test_a_rebuild_with_other_content_is_refused_unless_replaced(tmp_path: Path) -> None:
    from forgeflow.common.errors import DerivedSetConflictError

    first = derive("x = static & verified_any", [STATIC, VERIFIED])["x"]
    path = save_derived(first, tmp_path).path
    before = path.read_bytes()

    same = save_derived(derive("x = static ∩ verified_any", [STATIC, VERIFIED])["x"], tmp_path)
    assert same.written is False and path.read_bytes() == before  # an identical rebuild is a no-op

    grown = derive("x = static & verified_any", [STATIC, _explicit("verified_any", ["a", "b", "c", "e"])])["x"]
    with pytest.raises(DerivedSetConflictError) as info:
        save_derived(grown, tmp_path)
    message = str(info.value)
    assert f"already exists at {path} with 3 ids, ids sha256 {first.ids_sha256}" in message
    assert f"the rebuild has 4 ids, ids sha256 {grown.ids_sha256}" in message
    assert "1 added, 0 removed" in message and "'verified_any'" in message and "--replace" in message
    assert path.read_bytes() == before and not (tmp_path / "replaced").exists()

    done = save_derived(grown, tmp_path, replace=True)
    assert done.written and done.previous == first
    assert read_derived(path).ids == ["a", "b", "c", "e"]
    assert done.previous_path is not None and done.previous_path.parent == tmp_path / "replaced"
    assert done.previous_path.read_bytes() == before  # the previous content stays recoverable
    assert read_derived(done.previous_path).ids_sha256 == first.ids_sha256


@pytest.mark.parametrize("name", ["../demo/summary", "../demo/freezes/demo-v1", "a/b", "a\\b", "..", "", "a.b"])
def test_a_derived_set_name_is_a_plain_name_never_a_path(name: str) -> None:
    from forgeflow.curation.derived import validate_derived_name

    with pytest.raises(InputError, match="no path separators or '..'"):
        validate_derived_name(name)
    assert validate_derived_name("solved_v2") == "solved_v2"
