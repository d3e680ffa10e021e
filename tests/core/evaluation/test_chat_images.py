"""A canary task row's images reach the model in the OpenAI image format, and stay by digest elsewhere.

The request is recorded by the loopback fake of the OpenAI HTTP API that the model client's own tests use
(``tests/core/evaluation/test_model_client.py``); the image is a red square drawn with PIL, as the seeds'
serving acceptance draws one."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from forgeflow.common.errors import DigestMismatchError, InputError
from forgeflow.common.fsutil import sha256_bytes
from forgeflow.evaluation.canary import CanaryTask
from forgeflow.evaluation.chat_images import with_images
from forgeflow.evaluation.model_client import cache_key, chat_request
from tests.core.evaluation.test_model_client import DIGEST, client_for, fake  # noqa: F401 - the fixture


def _png(color: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(out, format="PNG")
    return out.getvalue()


def test_a_task_rows_images_are_sent_with_the_first_user_turn_and_kept_by_digest(fake, tmp_path: Path) -> None:  # noqa: F811
    red, blue = _png("red"), _png("blue")
    shot = tmp_path / "screenshot.png"
    shot.write_bytes(red)
    uri = "data:image/png;base64," + base64.b64encode(blue).decode()
    row = SimpleNamespace(instance_id="calc__1", repo="calc", patch="diff", problem_statement="The chart is red",
                          images=[str(shot), uri])
    task = CanaryTask.from_row(row, "reg/calc:1", "sha256:" + "0" * 64, "pytest -rA", ["t::a"], [])
    refs = task.image_refs(tmp_path / "images")
    assert [r.sha256 for r in refs] == [sha256_bytes(red), sha256_bytes(blue)]
    assert refs[1].path == tmp_path / "images" / f"{sha256_bytes(blue)}.png"  # the URI's bytes, stored once
    messages = with_images([{"role": "system", "content": "You fix bugs."},
                            {"role": "user", "content": task.problem_statement}], refs)

    client = client_for(fake)
    try:
        client.chat(chat_request("forgeflow", messages, max_tokens=8))
    finally:
        client.close()
    sent = fake.bodies[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "You fix bugs."}
    text, *images = sent[1]["content"]
    assert text == {"type": "text", "text": "The chart is red"}
    assert [p["type"] for p in images] == ["image_url", "image_url"]
    assert [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in images] == [red, blue]
    assert images[0]["image_url"]["url"].startswith("data:image/png;base64,")
    # what a trajectory keeps: the turn's text and each image by digest, never its bytes
    kept = json.dumps(messages)
    assert sha256_bytes(red) in kept and base64.b64encode(red).decode() not in kept
    # another image is another request (the cache never answers one with the other's answer)
    swapped = with_images(messages[:1] + [{"role": "user", "content": "The chart is red"}], refs[::-1])
    assert cache_key(DIGEST, chat_request("m", messages)) != cache_key(DIGEST, chat_request("m", swapped))
    # a text task's dump (its trials' cache key) is what it was; bad images are refused, naming them
    plain = CanaryTask.from_row(SimpleNamespace(**{**vars(row), "images": None}), "reg/calc:1",
                                "sha256:" + "0" * 64, "pytest -rA", ["t::a"], [])
    assert "images" not in plain.model_dump() and "images" in task.model_dump()
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(InputError, match="notes.txt.*not a PNG"):
        task.model_copy(update={"images": [str(tmp_path / "notes.txt")]}).image_refs(tmp_path / "images")
    shot.write_bytes(blue)  # the file changed after its digest was taken: never sent as the recorded image
    with pytest.raises(DigestMismatchError, match=sha256_bytes(red)):
        chat_request("m", messages).api_body()
