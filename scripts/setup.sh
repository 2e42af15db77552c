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
"${pip[@]}" --no-build-isolation -e ".[serve,plot,place,test]"
