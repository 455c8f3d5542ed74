#!/usr/bin/env python3
"""A change to the decode kernels against the build before it, the two alternated on one GPU
(`gpu_run.sh decoders` with STEP=ab): per generate cell (model, dtype, batch), each build's decode
step p50 in every round, their medians, and this build's median over the one before's (below 1: this
build is faster), with each build's median time to first token. A cell that either build ran on slowed
clocks, or beside another process, in some round (its row's verdict `throttled` or `shared`) says so:
its ratio is not one to plan on.

usage: decode_ab.py BEFORE_1 THIS_1 [BEFORE_2 THIS_2 ...] [--markdown]
"""
import os
import statistics
import sys

from compare import migprof_rows, print_table

DOUBTFUL = ("throttled", "shared")


def generate_rows(folder):
    """The generate rows of a results folder by (model, dtype, batch), the latest run winning
    (compare.migprof_rows); none where the build wrote no rows (it failed before its first), which the table counts as a missed
    round instead of losing the other rounds."""
    if not os.path.isdir(f"{folder}/runs"):
        return {}
    rows = migprof_rows(folder).items()
    return {(model, dtype, batch): r for (model, mode, dtype, batch), r in rows if mode == "generate"}


def main():
    args = sys.argv[1:]
    markdown = "--markdown" in args
    args = [a for a in args if a != "--markdown"]
    if not args or len(args) % 2:
        sys.exit(__doc__)
    sides = {"before": [generate_rows(f) for f in args[0::2]], "this": [generate_rows(f) for f in args[1::2]]}
    cells = sorted(set().union(*(r.keys() for rounds in sides.values() for r in rounds)))
    header = ["model", "dtype", "batch", "before p50 ms", "this p50 ms", "median before", "median this",
              "this / before", "TTFT ms before / this", "note"]
    table = []
    for cell in cells:
        p50, ttft, notes = {}, {}, []
        for side, rounds in sides.items():
            got = [r[cell] for r in rounds if cell in r]
            p50[side] = [g["p50_ms"] for g in got]
            ttft[side] = [g["ttft_p50_ms"] for g in got]
            if len(got) < len(rounds):
                notes.append(f"{side}: {len(got)} of {len(rounds)} rounds")
            doubtful = sorted({g["verdict"] for g in got if g.get("verdict") in DOUBTFUL})
            if doubtful:
                notes.append(f"{side}: {', '.join(doubtful)}")
        if not p50["before"] or not p50["this"]:
            ratio = "—"
        else:
            ratio = f"{statistics.median(p50['this']) / statistics.median(p50['before']):.3f}"
        median = {s: f"{statistics.median(v):.3f}" if v else "—" for s, v in p50.items()}
        first = {s: f"{statistics.median(v):.2f}" if v else "—" for s, v in ttft.items()}
        table.append([cell[0], cell[1], str(cell[2]),
                      ", ".join(f"{v:.3f}" for v in p50["before"]) or "—",
                      ", ".join(f"{v:.3f}" for v in p50["this"]) or "—",
                      median["before"], median["this"], ratio,
                      f"{first['before']} / {first['this']}", "; ".join(notes) or "ok"])
    print_table(header, table, markdown)
    rounds = len(args) // 2
    print(f"{rounds} round{'s' if rounds != 1 else ''}, {len(cells)} cells")


if __name__ == "__main__":
    main()
