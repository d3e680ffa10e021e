"""Headless Chromium (Debian package ``chromium``) driven over the Chrome DevTools Protocol: the browser the UI
checks use (``tests/flows/test_ui_browser.py``, ``tests/flows/test_ui_scale.py`` through
:mod:`benchmarks.scale_ui`). One browser, one page; a page is read once its single-page app has rendered the
expected text; its DOM and a PNG screenshot are kept."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx


class Browser:
    """Headless Chromium with one page, driven over the Chrome DevTools Protocol (websocket)."""

    def __init__(self, profile: Path) -> None:
        from websockets.sync.client import connect

        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--remote-allow-origins=*", "--window-size=1440,1800", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and len(port_file.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().splitlines()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._id = 0
        self.send("Page.enable")
        self.send("Runtime.enable")

    def send(self, method: str, params: dict | None = None, timeout_s: float = 60.0) -> dict:
        """One CDP command; returns its result (events in between are skipped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def text(self) -> str:
        """The rendered text of the page (``document.body.innerText``)."""
        result = self.send("Runtime.evaluate", {"expression": "document.body ? document.body.innerText : ''",
                                                "returnByValue": True})
        return result["result"].get("value", "")

    def tables(self) -> list[list[str]]:
        """Every rendered table row (``tr``) as its cells' visible text, header rows included."""
        expression = ("Array.from(document.querySelectorAll('tr')).map(tr => "
                      "Array.from(tr.querySelectorAll('th,td')).map(c => c.innerText.trim()))")
        return self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"]["value"]

    def open(self, url: str, needles: list[str], out: Path, timeout_s: float = 45.0) -> str:
        """Navigate to ``url``, wait until every needle is in the rendered text, keep the DOM and a
        full-page PNG as ``out.html`` / ``out.png``; returns the text (AssertionError naming the
        missing needles on timeout, with the DOM and screenshot kept)."""
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            missing = [n for n in needles if n not in text]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(0.5)  # let the last paint land before the screenshot
        dom = self.send("Runtime.evaluate", {"expression": "document.documentElement.outerHTML",
                                             "returnByValue": True})["result"]["value"]
        out.with_suffix(".html").write_text(dom)
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        out.with_suffix(".png").write_bytes(base64.b64decode(shot["data"]))
        print(f"{url}\n  screenshot {out.with_suffix('.png')}\n  DOM {out.with_suffix('.html')}")
        assert not missing, f"{url} never rendered {missing}; it shows:\n{text[:3000]}"
        return text

    def close(self) -> None:
        """Close the websocket and stop the browser by PID (its process group)."""
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
