"""`python -m sched_lifetime ab [--n N --mib M --lag CYCLES --steps S --json FILE]`: the
lifetime A/B (record_stream vs scheduled release), a table on stdout."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sched_lifetime")
    sub = p.add_subparsers(dest="cmd", required=True)
    ab = sub.add_parser("ab", help="record_stream vs scheduled release on a lagging two-stream pipeline")
    ab.add_argument("--n", type=int, default=16, help="tensors per step (default 16)")
    ab.add_argument("--mib", type=int, default=64, help="MiB per tensor (default 64)")
    ab.add_argument("--lag", type=int, default=2_000_000, help="consumer delay in GPU cycles (default 2e6, ~1 ms)")
    ab.add_argument("--steps", type=int, default=5)
    ab.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ab.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    from . import ab as ab_mod

    for name in ("n", "mib", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.lag < 0:
        p.error("--lag must be >= 0")
    res = ab_mod.run_ab(n=args.n, mib=args.mib, lag=args.lag, steps=args.steps, device=args.device)
    print(ab_mod.format_table(res))
    if args.json:
        rows = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in res["rows"].items()}
        with open(args.json, "w") as f:
            json.dump({**{k: v for k, v in res.items() if k != "rows"}, "rows": rows}, f, indent=1)
    if not res["outputs_equal"]:
        print("error: the two arms produced different outputs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
