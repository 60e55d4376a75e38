"""The `specbatch` command line.

User errors print one line on stderr and exit 2, without a traceback.
"""
from __future__ import annotations

import argparse
import sys


class UserError(Exception):
    """A problem with the user's input: reported in one line, exit code 2."""


def cmd_check_trace(args) -> int:
    from .invariants import TraceError, check_trace

    try:
        violations = check_trace(args.file)
    except TraceError as e:
        raise UserError(f"cannot read trace: {e}") from None
    if violations:
        print(f"{args.file}: INVALID: {violations[0]}")
        if len(violations) > 1:
            print(f"({len(violations) - 1} more violation(s); first shown)")
        return 1
    print(f"{args.file}: valid")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbatch", description="Batch speculative decoding that is "
                                     "provably output-equivalent to target-only decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("check-trace", help="validate a round trace against the invariants (exit 0 valid, "
                       "1 violation, 2 unreadable)")
    p.add_argument("file", help="trace file (JSONL) written with trace=")
    p.set_defaults(run=cmd_check_trace)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UserError as e:
        print(f"specbatch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specbatch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
