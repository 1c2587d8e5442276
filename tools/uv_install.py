"""Install into the venv this script runs in with uv, under the pip settings of this machine.

``VENV/bin/python tools/uv_install.py ARGS...`` puts uv (:data:`UV_VERSION`) into the venv with
the venv's pip, then runs ``uv pip install --python VENV/bin/python ARGS...``; ``--uninstall
NAMES...`` runs ``uv pip uninstall`` instead. uv installs the same pinned packages as pip, in
seconds where pip took minutes, and compiles none of them (the figures: docs/development.md).

uv reads settings of its own, not pip's. So that a machine set up for pip (an index, extra indexes,
find-links folders, constraint files, a CA bundle) installs the same way, what ``pip config list``
shows (pip's files and ``PIP_*`` variables) is passed to uv in its variables, unless the caller
set that variable already. A local folder that does not exist is left out, as pip ignores it.
uv takes each package from the best match over every index, as pip does
(``UV_INDEX_STRATEGY=unsafe-best-match``), not from the first index that has it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

#: The uv every set-up installs (pinned: a new uv is a change to review, as a new lock is).
UV_VERSION = "0.13.9"
#: pip's keys (in the ``global`` and ``install`` sections and ``PIP_*``) and uv's variables.
LISTS = {
    "index-url": ("UV_DEFAULT_INDEX", " "),
    "extra-index-url": ("UV_INDEX", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "trusted-host": ("UV_INSECURE_HOST", " "),
}
SINGLE = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT"}
#: Two names of one pip option (``timeout`` in a file, ``PIP_DEFAULT_TIMEOUT``): one key
ALIASES = {"default-timeout": "timeout"}
#: pip install's sections, each overriding the one before (":env:": ``PIP_*``)
SECTIONS = ("global", "install", ":env:")


def pip_settings(python: str) -> dict[str, str]:
    """pip's settings for ``pip install``: key to value. As in pip, ``[install]`` overrides
    ``[global]`` and a ``PIP_*`` variable both (``pip config list`` lists them sorted by name)."""
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in listed.splitlines():
        name, sep, raw = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or section not in SECTIONS:
            continue
        try:
            value = ast.literal_eval(raw)
        except (SyntaxError, ValueError):
            value = raw
        found.append((SECTIONS.index(section), ALIASES.get(key, key), str(value)))
    return {key: value for _, key, value in sorted(found, key=lambda item: item[0])}


def _exists(location: str) -> bool:
    """False for a local folder or file (a path or a file:// URL) that is not there."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path).exists()
    if parsed.scheme in ("http", "https"):
        return True
    return Path(location).exists()


def uv_environment(settings: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with uv's variables for ``settings`` added (what ``environ`` sets wins)."""
    env = dict(environ)
    for key, (variable, joiner) in LISTS.items():
        values = [v for v in settings.get(key, "").split() if v]
        if key != "trusted-host":
            values = [v for v in values if _exists(v)]
        if values and variable not in env:
            env[variable] = joiner.join(values)
    for key, variable in SINGLE.items():
        if settings.get(key) and variable not in env:
            env[variable] = settings[key]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        env.setdefault("UV_NO_INDEX", "1")
    env.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    return env


def main(argv: list[str]) -> int:
    python = sys.executable
    uv = Path(python).with_name("uv")
    version = subprocess.run([uv, "--version"], capture_output=True, text=True).stdout if uv.exists() else ""
    if f"uv {UV_VERSION}" not in version:
        subprocess.run([python, "-m", "pip", "install", "--quiet", f"uv=={UV_VERSION}"], check=True)
    env = uv_environment(pip_settings(python), dict(os.environ))
    verb = "uninstall" if "--uninstall" in argv else "install"
    args = [a for a in argv if a != "--uninstall"]
    command = [str(uv), "pip", verb, "--python", python, *args]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
