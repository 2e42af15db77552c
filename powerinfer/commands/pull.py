"""`powerinfer pull`: fetch the default model."""

from __future__ import annotations

import argparse

from powerinfer.hub import pull_default_model


def main(args: argparse.Namespace) -> int:
    print(pull_default_model())
    return 0
