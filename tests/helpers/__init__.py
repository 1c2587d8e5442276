"""Helpers the tests import (fixtures stay in tests/conftest.py): jobs.py (paths, job and
Parquet writers, the CLI runner), fakes.py (an engine without vLLM), emulators.py (the stores'
servers), faultproxy.py, recovery.py (a run as a killable process), shared_engines.py, chromium.py
(headless Chromium over the DevTools protocol)."""
