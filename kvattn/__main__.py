"""`python -m kvattn`: self-check and timing on the GPU (or compile + reference without one).
`python -m kvattn compile [--arch sm_90a]`: build every registered kernel instantiation."""
from __future__ import annotations

import argparse
import sys

from . import selfcheck


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvattn", description=__doc__)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("compile", help="compile every registered kernel to a cubin; fail on errors, spills or "
                                              "serialised wgmma")
    c.add_argument("--arch", default="sm_90a")
    c.add_argument("--op", action="append", help="only these ops (repeatable)")
    args = ap.parse_args(argv)
    if args.cmd == "compile":
        return selfcheck.compile_all(args.arch, args.op)
    return selfcheck.run()


if __name__ == "__main__":
    sys.exit(main())
