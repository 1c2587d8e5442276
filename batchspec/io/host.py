"""This host and its processes: the host name leases record, whether a pid is alive."""

from __future__ import annotations

import os
import random
import socket
import time


def this_host() -> str:
    """This machine's host name, as leases and temporary file names record it."""
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def random_sleep(max_s: float) -> None:
    """Sleep a random time up to ``max_s`` seconds."""
    time.sleep(random.random() * max_s)
