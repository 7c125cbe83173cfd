"""`tandem bench compare`: Tandem beside its peers, offline (compare_offline) or served
(`--served`, compare_served); this module only checks that the flags fit the mode and hands over.
"""

from __future__ import annotations

import argparse
import os

from tandem.bench.compare_args import MODE_FLAGS, OFFLINE_WORKLOADS, SERVED_WORKLOADS


def check_mode_flags(args: argparse.Namespace) -> None:
    """Refuses a flag of the other mode by name: ignored, it would measure something else than
    asked (a --concurrency offline, an --engines list served)."""
    mode = "served" if args.served else "offline"
    for dest, (owner, flag) in MODE_FLAGS.items():
        if owner != mode and getattr(args, dest, None) is not None:
            if owner == "served":
                raise ValueError(f"{flag} is a flag of the served comparison: add --served")
            raise ValueError(f"{flag} is a flag of the offline comparison: drop --served")
    ours, theirs = (SERVED_WORKLOADS, OFFLINE_WORKLOADS) if args.served else (OFFLINE_WORKLOADS, SERVED_WORKLOADS)  # fmt: skip
    if args.workload is None or args.workload in ours:
        return
    if args.workload in theirs:
        where = "offline comparison: drop --served" if args.served else "served comparison: add --served"  # fmt: skip
        raise ValueError(f"--workload {args.workload} is a workload of the {where}")
    raise ValueError(f"--workload {args.workload}: choose from {', '.join(ours)}")


def run_compare(args: argparse.Namespace) -> int:
    check_mode_flags(args)
    # No model hub: every engine reads local files only. Set before transformers is imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.served:
        from tandem.bench.compare_served import run_served

        return run_served(args)
    from tandem.bench.compare_offline import run_offline

    return run_offline(args)
