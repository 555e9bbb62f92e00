"""Generate (or check) the README's performance tables from a committed results file.

The README's figures must come from a run the repository can repeat, with its machine
named. This script is the only writer of the block between the markers
``<!-- omnilink-bench:begin ... -->`` and ``<!-- omnilink-bench:end -->``::

    python benchmarks/make_readme_table.py benchmarks/results/RUN.jsonl            # print
    python benchmarks/make_readme_table.py benchmarks/results/RUN.jsonl --write README.md
    python benchmarks/make_readme_table.py benchmarks/results/RUN.jsonl --check README.md
    python benchmarks/make_readme_table.py benchmarks/results/RUN.jsonl --plot RUN.png

``--check`` exits 1 when the README's block differs from what the results file gives.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from omnilink._bench.report import (  # noqa: E402
    PlotUnavailable,
    plot_title,
    read_jsonl,
    readme_block,
    replace_readme_block,
    write_plot,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a JSON-lines file written by `omnilink bench --json`")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="README", help="replace the generated block in README")
    group.add_argument("--check", metavar="README", help="fail if README's block is out of date")
    group.add_argument("--plot", metavar="PNG", help="(re)draw the run's plot (needs matplotlib)")
    args = parser.parse_args(argv)

    try:
        records = read_jsonl(args.results)
        block = readme_block(records, source=args.results)
    except (OSError, ValueError) as exc:
        print(f"make_readme_table: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            write_plot(args.plot, records, title=plot_title(records[0]["scenario"], records[0]["machine"]))
        except PlotUnavailable as exc:
            print(f"make_readme_table: {exc}", file=sys.stderr)
            return 2
        return 0
    if not (args.write or args.check):
        sys.stdout.write(block)
        return 0
    path = args.write or args.check
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = replace_readme_block(text, block)
    except (OSError, ValueError) as exc:
        print(f"make_readme_table: {path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"make_readme_table: {path} is out of date with {args.results}; run with "
                  f"--write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
