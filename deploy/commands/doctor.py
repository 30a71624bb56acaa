"""`omrl doctor`: every check a run needs (deploy/preflight.py), as a table or JSON."""

from __future__ import annotations

import argparse

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    from common.cli import config_from_args
    from deploy.preflight import doctor_report, print_cause, run_checks

    cfg = config_from_args(args)
    results = run_checks(cfg, "doctor")
    if args.debug:
        for r in results:
            if r.status == "fail":
                print_cause(r)
    print(doctor_report(results, args.json))
    return 2 if any(r.status == "fail" for r in results) else 0
