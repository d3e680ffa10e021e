"""Issue 36: a window keeps the images its turns carried (the task's, and a replayed turn's), by digest, and the
windows' JSONL has the image files beside it, so ``sft-burst`` reads it as it reads any image samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file
from forgeflow.evaluation.chat_images import image_ref
from forgeflow.training.jsonl import read_sft_jsonl
from forgeflow.training.windows import WindowConfig, build_windows, window_samples, write_window_jsonl
from tests.core.training.test_windows import text_trajectory

CONFIG = WindowConfig(replay_steps=2, stride_steps=2, min_steps=4)
COMMANDS = [f"cat file{i}.py" for i in range(7)]


def _png(path: Path, rgb: tuple[int, int, int]) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), rgb).save(path)
    return path


def _with_images(trajectory: dict[str, Any], images: dict[int, list[Path]], store: Path) -> dict[str, Any]:
    """``trajectory`` with each message index's images under ``images``, as the canary records them."""
    messages = [dict(m) for m in trajectory["messages"]]
    for index, paths in images.items():
        messages[index]["images"] = [image_ref(p, store).model_dump(mode="json") for p in paths]
    return {**trajectory, "messages": messages}


def _text_of(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample with every image part dropped and text parts joined back into a string content."""
    def turn(m: dict[str, Any]) -> dict[str, Any]:
        if isinstance(m["content"], str):
            return m
        return {**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}

    return {**sample, "prompt": [turn(m) for m in sample["prompt"]],
            "completion": [turn(m) for m in sample["completion"]]}


def test_a_windows_prompt_keeps_the_task_and_replayed_turns_images_and_the_files_go_beside_the_jsonl(
        tmp_path: Path) -> None:
    shots = tmp_path / "canary" / "images"
    red, blue = _png(shots / "red.png", (255, 0, 0)), _png(shots / "blue.png", (0, 0, 255))
    text = text_trajectory(COMMANDS)
    # message 1: the task (first user turn); message 5: the observation of step 1 (a later user turn)
    traj = _with_images(text, {1: [red], 5: [blue]}, shots)
    path = tmp_path / "canary" / "t-1.traj.json"
    path.write_text(json.dumps(traj))
    built = build_windows([path], CONFIG)
    red_sha, blue_sha = sha256_file(red), sha256_file(blue)
    assert set(built.images) == {red_sha, blue_sha}
    samples = window_samples(built)
    plain = window_samples(build_windows([text], CONFIG))
    # the same windows as the text-only trajectory's, but for the image parts; and their provenance is theirs
    assert [_text_of(s) | {"source": None, "provenance": None} for s in samples] \
        == [s | {"source": None, "provenance": None} for s in plain]
    for sample in samples:
        task = sample["prompt"][1]
        assert task["role"] == "user" and task["content"][0]["type"] == "text"
        assert task["content"][1:] == [{"type": "image", "image": red_sha}]  # after the text, as the canary sent
    # the window whose replayed steps include step 1 has its observation's image, in that turn
    replaying = [s for s in samples if any(m["role"] == "user" and isinstance(m["content"], list)
                                           for m in s["prompt"][2:])]
    assert replaying and all({"type": "image", "image": blue_sha} in m["content"] for s in replaying
                             for m in s["prompt"][2:] if isinstance(m["content"], list))

    out = tmp_path / "windows" / "w.jsonl"
    written, _ = write_window_jsonl(built, out)
    assert sorted(p.name for p in out.parent.glob("*.png")) == sorted([f"{red_sha}.png", f"{blue_sha}.png"])
    rows = read_sft_jsonl(written)  # sft-burst's reader: each part resolved beside the JSONL, digest checked
    assert len(rows) == len(samples)
    (image,) = [p for p in rows[0]["prompt"][1]["content"] if p["type"] == "image"]
    assert image == {"type": "image", "image": str(out.parent / f"{red_sha}.png"), "sha256": red_sha}


def test_text_only_trajectories_write_what_they_wrote_before(tmp_path: Path) -> None:
    built = build_windows([text_trajectory(COMMANDS)], CONFIG)
    assert built.images == {} and "images" not in built.dataset.features["prompt"].feature
    path, _ = write_window_jsonl(built, tmp_path / "w.jsonl")
    assert [p.name for p in tmp_path.iterdir()] == ["w.jsonl"]
    assert all(isinstance(m["content"], str) and "images" not in m for line in path.read_text().splitlines()
               for m in json.loads(line)["prompt"])


def test_a_missing_or_changed_image_names_the_trajectory_and_the_digest(tmp_path: Path) -> None:
    shots = tmp_path / "store"
    red = _png(shots / "red.png", (255, 0, 0))
    digest = sha256_file(red)
    folder = tmp_path / "trajectories"
    folder.mkdir()
    path = folder / "t-1.traj.json"
    path.write_text(json.dumps(_with_images(text_trajectory(COMMANDS), {1: [red]}, shots)))
    red.write_bytes(red.read_bytes() + b"\0")
    with pytest.raises(InputError, match=rf"^{path}: trajectory of .* message 1: image {digest} .* now has sha256"):
        build_windows([path], CONFIG)
    red.unlink()
    with pytest.raises(InputError, match=rf"^{path}: trajectory of .* message 1: image {digest} is missing"):
        build_windows([path], CONFIG)
    # the trajectory's folder, moved with its images/ beside it, still finds them by digest
    _png(folder / "images" / f"{digest}.png", (255, 0, 0))
    assert set(build_windows([path], CONFIG).images) == {digest}
