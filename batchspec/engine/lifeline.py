"""Engine processes die with the batchspec process that started them.

vLLM runs its EngineCore in a child process, and its workers in children of that. When the
batchspec process is killed (``kill -9``, the kernel's OOM killer, a scheduler's last resort),
nothing tells them: they keep their memory, with no parent, for as long as the machine runs. A
nightly job would leak one engine per crash. So each engine process asks the kernel for a
SIGKILL when its parent goes (Linux's ``PR_SET_PDEATHSIG``): the EngineCore when the batchspec
process goes, each worker when its EngineCore goes.

The request is made by batchspec's vLLM plugin (:mod:`batchspec.engine.cpu_plugin`), which vLLM
loads in every process it starts. A parent-death signal follows the *thread* that started the
child, so batchspec asks for it only for engines started from its main thread (:func:`arm`),
whose end is the process's end. An engine started from another thread (a Ray replica, a threaded
actor, restarts its engine on the thread that runs its work) holds a watch instead: a thread in
the EngineCore that sees its parent go (its parent pid changes) within a second and kills it;
its workers hold their signal to it as usual."""

from __future__ import annotations

import os
import signal
import sys
import threading

#: The pid of the batchspec process whose main thread starts engines (set by :func:`arm`).
PARENT_ENV = "BATCHSPEC_ENGINE_PARENT_PID"
#: The pid of an EngineCore that holds its own lifeline (set in it by :func:`hold`).
CORE_ENV = "BATCHSPEC_ENGINE_CORE_PID"

#: Set with PARENT_ENV where the engine is started from another thread than the main one: the
#: EngineCore then watches its parent (a parent-death signal would follow that thread's end).
WATCH_ENV = "BATCHSPEC_ENGINE_PARENT_WATCH"
#: How often a watching EngineCore looks for its parent.
WATCH_INTERVAL_S = 0.5

_PR_SET_PDEATHSIG = 1


def arm() -> None:
    """Ask that engines started from now on die with this process: by a parent-death signal
    from the main thread, by the EngineCore's watch of its parent from any other (a parent-death
    signal follows the thread that started the child, which may end before the process)."""
    os.environ[PARENT_ENV] = str(os.getpid())
    if threading.current_thread() is threading.main_thread():
        os.environ.pop(WATCH_ENV, None)
    else:
        os.environ[WATCH_ENV] = "1"


def _watch(parent: int) -> None:
    """Kill this process once its parent ``parent`` is gone (this process re-parented)."""

    def run() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(WATCH_INTERVAL_S)

    threading.Thread(target=run, name="batchspec-lifeline", daemon=True).start()


def hold() -> bool:
    """In an engine process (called by the plugin): die with the parent, where this process is
    the EngineCore of an armed batchspec process or a worker of such an EngineCore. True if the
    lifeline is held."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if os.environ.get(PARENT_ENV) == str(parent):
        os.environ[CORE_ENV] = str(os.getpid())  # its workers hold theirs to it
        if os.environ.get(WATCH_ENV):
            _watch(parent)
            return True
    elif os.environ.get(CORE_ENV) != str(parent):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent went before the request: nobody is left to wait
        os.kill(os.getpid(), signal.SIGKILL)
    return True
