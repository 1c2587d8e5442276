"""Headless Chromium driven over the DevTools protocol, for tests that check what a browser sees:
console errors, failed loads, the DOM after scripts ran.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands on the browser's fd 3,
replies and events on its fd 4, each message JSON ended by a NUL byte), so there is no port to
pick and no websocket library to install. The browser is Debian's ``chromium`` package."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

#: Flags for a quiet, sandbox-free browser that reaches nothing but the pages it is sent to.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
)


#: Moves the pipe ends it is given to fds 3 and 4, then becomes the browser.
_TRAMPOLINE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
    "os.execvp(sys.argv[3], sys.argv[3:])"
)


def chromium_binary() -> str | None:
    """The browser's command, or None where it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(Exception):
    """The browser answered a command with an error, or did not answer in time."""


class Page:
    """One tab: what it logged, and a way to run JavaScript in it."""

    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session
        #: Console errors, uncaught exceptions and failed loads, as one line each.
        self.errors: list[str] = []

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.browser.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            self.session,
        )
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 10.0):
        """Poll a JavaScript expression until it is truthy; its value, or BrowserError."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout_s} s: {expression}")
            time.sleep(0.1)

    def insert_text(self, text: str) -> None:
        """Type ``text`` into the focused element, as a keyboard would."""
        self.browser.send("Input.insertText", {"text": text}, self.session)


class Browser:
    """A headless Chromium process; ``open(url)`` loads a page in a new tab."""

    def __init__(self, binary: str, profile: Path, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()
        # the browser wants them as fds 3 and 4: lift both out of the low numbers, then let a
        # trampoline put them there before it becomes the browser
        child_r = fcntl.fcntl(commands_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(replies_w, fcntl.F_DUPFD, 10)
        os.close(commands_r)
        os.close(replies_w)
        argv = [binary, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
        self.process = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(child_r), str(child_w), *argv],
            pass_fds=(child_r, child_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self._next_id = 0
        self._messages: queue.Queue = queue.Queue()
        self._pages: dict[str, Page] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._replies, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._messages.put(None)
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for message in messages:
                self._messages.put(json.loads(message))

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its reply; events that arrive meanwhile are recorded."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._next(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_event(self, method: str, page: Page) -> dict:
        """Wait for an event of ``page`` (``Page.loadEventFired``); its params."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._next(deadline, method)
            if message.get("method") == method and message.get("sessionId") == page.session:
                return message.get("params", {})

    def _next(self, deadline: float, waiting_for: str) -> dict:
        try:
            message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise BrowserError(f"no answer to {waiting_for} in {self.timeout_s} s") from None
        if message is None:
            raise BrowserError(f"the browser closed its pipe while {waiting_for} was pending")
        self._record(message)
        return message

    def _record(self, message: dict) -> None:
        page = self._pages.get(message.get("sessionId", ""))
        if page is None:
            return
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            page.errors.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            page.errors.append(
                "uncaught: " + str(details.get("exception", {}).get("description") or details.get("text"))
            )
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            page.errors.append(f"{entry['source']}: {entry['text']} {entry.get('url', '')}".strip())

    def open(self, url: str) -> Page:
        """Load ``url`` in a new tab and return once its load event has fired."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = self._pages[session] = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_event("Page.loadEventFired", page)
        return page

    def settle(self, seconds: float) -> None:
        """Let pages run for a while, recording what they log."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if message is None:
                return
            self._record(message)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=5)  # the browser is gone: its end of the pipe is closed
        os.close(self._commands)
        os.close(self._replies)
