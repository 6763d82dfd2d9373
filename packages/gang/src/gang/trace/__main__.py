"""``python -m gang.trace DIR``: who is behind, in which operation of which gang, read from flight-recorder dumps."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from gang.trace._analyze import analyze, load, render


def main(argv: Sequence[str] | None = None) -> int:
    """Read the dumps in a directory and print the summary (``--json``: as JSON); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m gang.trace",
        description="Summarise flight-recorder dumps (gang's gang_trace_rank_<rank>, or torch's own): "
        "per gang, the last sequence number of each rank, who is behind in which operation, mismatched calls.",
    )
    parser.add_argument("directory", type=Path, help="the directory of dumps (GANG_TRACE_DIR)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    parser.add_argument(
        "-p", "--prefix", default=None, help="the dump files' prefix before the rank (default: gang_trace_rank_)"
    )
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"`directory` must be a directory, but {str(args.directory)!r} is not.")
    try:
        dumps = load(args.directory, args.prefix)
    except ValueError as ex:
        print(f"gang.trace: {ex}", file=sys.stderr)
        return 1
    summary = analyze(dumps)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(render(summary, args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
