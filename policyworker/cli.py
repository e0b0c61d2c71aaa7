"""Command line: `policyworker demo | bench | info`."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="policyworker")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="GRPO loop on a toy task with a separate inference process")
    sub.add_parser("info", help="versions, devices, attention kernels and transports")
    args = parser.parse_args(argv)
    if args.command == "info":
        import torch

        import policyworker

        print(f"policyworker {policyworker.__version__}, torch {torch.__version__}")
        return 0
    print("policyworker demo: the GRPO demo is being built (issue 8).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
