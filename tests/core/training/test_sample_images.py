"""SFT samples with image turns read from a JSONL: images beside it by sha256 or relative path, checked per line.

No model is loaded: the JSONL reader resolves and checks each image (a missing file, a file that is no image, a
file named by a sha256 its bytes lack, an image in an assistant turn are refused naming the line); text-only
samples keep their digest; the dataset digest names images by sha256, so the same samples elsewhere are the
same dataset; a text-only base refuses image turns before loading anything; the vision-tower check after a burst
fails when a tower tensor moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeflow.common.errors import InputError
from forgeflow.common.fsutil import sha256_file, sha256_json
from forgeflow.training.burst import BurstConfig, build_sft_dataset, run_sft_burst
from forgeflow.training.jsonl import read_sft_jsonl


def _png(folder: Path, rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), rgb).save(folder / "new.png")
    digest = sha256_file(folder / "new.png")
    (folder / "new.png").rename(folder / f"{digest}.png")
    return digest


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(image: str, role: str = "user") -> dict:
    turn = {"role": role, "content": [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}]}
    if role == "user":
        return {"messages": [turn, {"role": "assistant", "content": "Red."}]}
    return {"messages": [{"role": "user", "content": "draw"}, turn]}


def test_image_turns_are_read_by_digest_and_bad_images_are_refused_naming_the_line(tmp_path: Path) -> None:
    red = _png(tmp_path / "a", (255, 0, 0))
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    samples = read_sft_jsonl(_write(tmp_path / "a" / "s.jsonl", [_row(red), _row(f"{red}.png"), text]))
    first, second = samples[0]["messages"][0]["content"][0], samples[1]["messages"][0]["content"][0]
    assert first == second == {"type": "image", "image": str(tmp_path / "a" / f"{red}.png"), "sha256": red}
    data = build_sft_dataset(samples)
    assert [len(r["messages"][0]["content"]) for r in data.dataset] == [2, 2, 1]  # uniform parts, text kept

    # the same files in another folder: the same dataset digest (images by sha256, never by path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / f"{red}.png").write_bytes((tmp_path / "a" / f"{red}.png").read_bytes())
    again = read_sft_jsonl(_write(tmp_path / "b" / "s.jsonl", [_row(red), _row(f"{red}.png"), text]))
    assert build_sft_dataset(again).sha256 == data.sha256
    # text-only samples keep the digest they always had
    plain = read_sft_jsonl(_write(tmp_path / "t.jsonl", [text]))
    assert build_sft_dataset(plain).sha256 == sha256_json(
        [{**text, "instance_id": "t:1", "source": "jsonl"}])

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "notes.png").write_text("not an image\n")
    (bad / ("0" * 64 + ".png")).write_bytes((tmp_path / "a" / f"{red}.png").read_bytes())
    cases = {
        "missing.png": r"line 2: messages\[0\]\.content\[0\]: image 'missing.png' is not a file beside the samples",
        "notes.png": r"line 2: messages\[0\]\.content\[0\]: image 'notes.png' .*not a PNG, JPEG, GIF or WebP",
        "0" * 64: r"line 2: .* is named by sha256 0{64} but its bytes hash to " + red,
    }
    for image, message in cases.items():
        with pytest.raises(InputError, match=message):
            read_sft_jsonl(_write(bad / "s.jsonl", [text, _row(image)]))
    with pytest.raises(InputError, match=r"line 1: .*an image part in a assistant turn"):
        read_sft_jsonl(_write(bad / "s.jsonl", [_row(red, role="assistant")]))

    # a text-only base refuses image turns before any model loads (the tiny text config is enough)
    text_base = tmp_path / "text-base"
    text_base.mkdir()
    (text_base / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(InputError, match="the samples carry images but base model .* has no vision_config"):
        run_sft_burst(text_base, data, tmp_path / "adapter", BurstConfig())
    assert not (tmp_path / "adapter").exists()


def test_the_burst_refuses_an_adapter_whose_vision_tower_moved() -> None:
    import torch

    from forgeflow.training.health import BurstHealthError
    from forgeflow.training.vl_burst import VLBurstInputs, check_tower_unchanged, vision_state_sha256

    model = torch.nn.Module()
    model.visual = torch.nn.Linear(2, 2)
    model.language_model = torch.nn.Linear(2, 2)
    before = vision_state_sha256(model)
    inputs = VLBurstInputs(model=model, processor=None, dataset=None, vision_tower_sha256="0" * 64,
                           state_sha256=before)
    with torch.no_grad():
        model.language_model.weight.add_(1.0)
    check_tower_unchanged(model, inputs, None)  # the language model may move
    with torch.no_grad():
        model.visual.weight.add_(1.0)
    with pytest.raises(BurstHealthError, match="the vision tower changed during the burst"):
        check_tower_unchanged(model, inputs, None)
