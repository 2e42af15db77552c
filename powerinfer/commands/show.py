"""`powerinfer show MODEL [--json]`: what a model file holds, read from its header."""

from __future__ import annotations

import argparse
import json

from powerinfer.commands.common import model_path
from powerinfer.tools.show import as_text, describe


def main(args: argparse.Namespace) -> int:
    info = describe(model_path(args))
    print(json.dumps(info, indent=2) if args.json else as_text(info))
    return 0
