"""`tandem bench serve`: the command, from its flags to the report (the load itself is
`serve.py`'s, the rounds of `--compare` and `--dashboard-ab` `serve_rounds.py`'s)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tandem.bench import serve_report
from tandem.bench.serve import (
    args_prompts,
    base_url,
    check_args,
    load_config,
    result_metadata,
    run_load,
)
from tandem.bench.serve_agent import run_agent_bench
from tandem.bench.serve_metrics import detailed, finite, summarize
from tandem.bench.serve_rounds import run_rounds


def run_serve_bench(args: argparse.Namespace) -> int:
    """The command: 0 when every request completed, 1 when some failed (ValueError for a bad
    flag, before anything is sent)."""
    spec = check_args(args)
    url = base_url(args)
    if args.compare is not None or args.dashboard_ab:
        return run_rounds(args, url, spec)
    if args.dataset_name == "agent":
        cell = asyncio.run(run_agent_bench(url, args))
        results, duration, model = cell.results, cell.wall_s, cell.model
        summary = summarize(results, duration, spec) | cell.agent_summary()
        title = f"{model}: {args.sessions} agent sessions x {args.turns} turns through {url}"
    else:
        run = asyncio.run(run_load(url, args_prompts(args), load_config(args)))
        results, duration, model = run.results, run.duration_s, run.model
        summary = run.summary(spec)
        title = (
            f"{model}: {args.num_prompts} requests through /{args.api}, at most "
            f"{args.max_concurrency} in flight, {args.request_rate} req/s"
        )
    result = result_metadata(args, url, model) | summary
    if args.save_result:
        extra = detailed(results) if args.save_detailed else {}
        path = serve_report.save_result(result | extra, args)
        print(f"result: {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(finite(result), indent=2))
    else:
        serve_report.print_result(result, spec)
    if args.plot:
        serve_report.draw(results, args.plot, title)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 1 if summary["failed"] else 0
