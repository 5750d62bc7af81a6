"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ending
in NUL on file descriptors 3 and 4), so the viewer's tests run a real browser with no driver package."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

BINARY = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = "no chromium on PATH (Debian's 'chromium' package; make test-all's set-up installs it)"


class Browser:
    """One headless Chromium with one page; `evaluate` runs a script in it, `click` presses the mouse on an
    element as a person would."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 900):
        commands_read, self._commands = os.pipe()
        self._events, events_write = os.pipe()
        # Copies above 9, closed at exec, so that moving them onto 3 and 4 cannot overwrite one another.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands_read, events_write)]

        def as_fds_3_and_4():  # in the child, before exec: the ends Chromium reads and writes (inheritable)
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [BINARY, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=as_fds_3_and_4,  # (every other descriptor of ours closes at exec)
            # Its caches in the profile: on a machine where it never ran, GLib's dconf creates ~/.cache/dconf (the
            # tests' isolation check failed the complete suite's first run on a new machine there).
            env={**os.environ, "XDG_CACHE_HOME": str(profile / "cache"), "XDG_CONFIG_HOME": str(profile / "config")})
        for fd in (commands_read, events_write, *high):
            os.close(fd)
        self._buffer = b""
        self._id = 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def _call(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._events, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def call(self, method: str, params: dict | None = None) -> dict[str, Any]:
        return self._call(method, params, self._session)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, path: Path, fragment: str = "", timeout: float = 60.0) -> float:
        """Load `path` (with `#fragment`, as a link names it) and wait until the page says it is drawn
        (body[data-ready]); the seconds it took. Through about:blank, so that the same page with another fragment
        loads anew, as a link opened in a new tab does."""
        start = time.perf_counter()
        self.call("Page.navigate", {"url": "about:blank"})
        self.call("Page.navigate", {"url": path.resolve().as_uri() + (f"#{fragment}" if fragment else "")})
        while self.evaluate("document.readyState === 'complete' && document.body.dataset.ready === '1'") is not True:
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{path} was not drawn within {timeout} s")
            time.sleep(0.05)
        return time.perf_counter() - start

    def click(self, selector: str) -> None:
        """A mouse press and release at the centre of the first element matching `selector`."""
        box = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
                            "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent",
                      {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1})

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"]))
        return path

    def close(self) -> None:
        try:
            self._call("Browser.close")
        except RuntimeError:
            pass  # it closed the pipe while answering
        finally:
            os.close(self._commands)
            os.close(self._events)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
