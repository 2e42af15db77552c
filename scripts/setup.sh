#!/usr/bin/env bash
# Creates .venv and installs powerinfer with everything its commands and tests use.
# torch is pinned to the CPU build first: an unpinned torch would pull a multi-GB CUDA build. The
# package is then built without build isolation, so that its C++ operators (compiled here, once)
# are built against that torch rather than one fetched for the build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0 "setuptools>=70" "ninja>=1.11"
"${pip[@]}" --no-build-isolation -e ".[serve,plot,place,ray,test]"
# tmux drives the chat tests (tests/test_chat.py, which skip without it): installed where apt can.
if ! command -v tmux >/dev/null && command -v apt-get >/dev/null; then
    sudo=$([ "$(id -u)" -eq 0 ] || echo "sudo -n")
    { $sudo apt-get update -qq && $sudo apt-get install -y -qq tmux; } >/dev/null \
        || echo "scripts/setup.sh: could not install tmux; tests/test_chat.py will be skipped" >&2
fi
