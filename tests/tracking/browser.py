"""Headless Chromium (Debian's ``chromium`` package) driven over the Chrome DevTools
protocol: open a page, wait until a JavaScript condition holds, read what it shows and take
a screenshot. Only aiohttp (already installed with Ray) and the browser are needed."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRE_ENV = "HIERTX_REQUIRE_BROWSER"  # "1": a missing browser fails the test (CI)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",  # as root in a container
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1920,1080",
    "--remote-debugging-port=0",  # the browser picks a port (DevToolsActivePort)
)


def find_chromium() -> str | None:
    """The browser's path: ``$CHROMIUM`` or the first of :data:`CANDIDATES` on ``PATH``."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


@dataclass
class Page:
    """What a page showed once its condition held (or the wait ended)."""

    url: str  # location.href: where the app's redirects led
    text: str  # document.body.innerText
    html: str  # document.documentElement.outerHTML
    ready: bool  # whether the condition held before the timeout
    screenshot: Path | None


def render(
    binary: str, url: str, ready: str, timeout: float = 60, screenshot: Path | None = None
) -> Page:
    """Open ``url`` in a fresh headless browser (its own profile, deleted afterwards), wait
    until the JavaScript expression ``ready`` is true (or ``timeout`` seconds), then read
    the page and write a PNG screenshot to ``screenshot``."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own group: closing it ends its helper processes
        )
        try:
            port = _devtools_port(Path(profile), process, timeout)
            return asyncio.run(_drive(port, url, ready, timeout, screenshot))
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=20)


def _devtools_port(profile: Path, process: subprocess.Popen, timeout: float) -> int:
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if active.is_file() and active.read_text().strip():
            return int(active.read_text().split()[0])
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with status {process.returncode} at start")
        time.sleep(0.1)
    raise RuntimeError(f"chromium did not open its DevTools port within {timeout:g} s")


async def _drive(port: int, url: str, ready: str, timeout: float, shot: Path | None) -> Page:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = json.loads(await response.text())
        page = next(t for t in targets if t.get("type") == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = itertools.count(1)

            async def call(method: str, **params: Any) -> dict[str, Any]:
                n = next(ids)
                await ws.send_json({"id": n, "method": method, "params": params})
                while True:  # events arrive in between: skip them
                    message = json.loads((await ws.receive()).data)
                    if message.get("id") == n:
                        if "error" in message:
                            raise RuntimeError(f"{method}: {message['error']}")
                        return message["result"]

            async def evaluate(expression: str) -> Any:
                result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                return result["result"].get("value")

            await call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            held = False
            while time.monotonic() < deadline:
                held = bool(await evaluate(f"Boolean({ready})"))
                if held:
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(1.0)  # let the last renders settle for the screenshot
            if shot is not None:
                data = await call("Page.captureScreenshot", format="png")
                shot.write_bytes(base64.b64decode(data["data"]))
            return Page(
                url=str(await evaluate("location.href")),
                text=str(await evaluate("document.body ? document.body.innerText : ''")),
                html=str(await evaluate("document.documentElement.outerHTML")),
                ready=held,
                screenshot=shot,
            )
