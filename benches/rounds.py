#!/usr/bin/env python3
"""The verdict over rounds of the comparison on one machine (`gpu_run.sh best` with ROUNDS=2): per cell,
migprof's throughput over the best PyTorch variant's in each round, the median of those ratios, and
whether the cell meets the performance goal — median at or above 1 and no round below 0.97. A cell
where either side was measured on slowed clocks in some round (migprof's verdict `throttled`, or
PyTorch's row's, read the same way) is not judged: its goal says `throttled`, and which side. With
--peak (peak_flops.py's output), migprof's model FLOP utilisation at its median throughput.

usage: rounds.py RESULTS_1 PYTORCH_1.jsonl [RESULTS_2 PYTORCH_2.jsonl ...] [--peak peak.json] [--markdown]
"""
import json
import statistics
import sys

from compare import migprof_rows, print_table


def best_pytorch(path):
    best = {}
    for p in (json.loads(line) for line in open(path) if line.strip()):
        if "throughput" not in p:  # a variant that failed, its error in the row
            continue
        key = (p["model"], p["mode"], p["dtype"], p["batch"])
        if key not in best or p["throughput"] > best[key]["throughput"]:
            best[key] = p
    return best


def main():
    args = sys.argv[1:]
    markdown = "--markdown" in args
    peak = None
    if "--peak" in args:
        i = args.index("--peak")
        peak = json.load(open(args[i + 1]))
        del args[i:i + 2]
    args = [a for a in args if a != "--markdown"]
    if not args or len(args) % 2:
        sys.exit(__doc__)
    rounds = [(migprof_rows(args[i]), best_pytorch(args[i + 1])) for i in range(0, len(args), 2)]
    cells = sorted({k for _, theirs in rounds for k in theirs}, key=lambda k: (k[0], k[1], k[2], k[3]))
    head = ["model", "mode", "dtype", "batch"] + [f"round {i + 1}" for i in range(len(rounds))] + ["median", "migprof/s", "pytorch/s", "best variant"]
    head += ["MFU"] if peak else []
    head += ["goal"]
    out, short, unjudged = [], 0, 0
    for key in cells:
        ratios, mine, theirs, variant, flops, slowed = [], [], [], "-", None, set()
        cols = []  # each round's ratio in its own column, "-" where the round lacks the cell
        for m, p in rounds:
            cols.append(f"{m[key]['throughput'] / p[key]['throughput']:.2f}" if key in m and key in p else "-")
            if key in m and key in p:
                ratios.append(m[key]["throughput"] / p[key]["throughput"])
                mine.append(m[key]["throughput"])
                theirs.append(p[key]["throughput"])
                variant = p[key].get("variant", "eager")
                flops = m[key]["flops_per_sample"]
                if m[key].get("verdict") == "throttled":
                    slowed.add("migprof")
                if p[key].get("verdict") == "throttled":
                    slowed.add("pytorch")
        if len(ratios) < len(rounds):
            # A cell missing from a round cannot be judged on the rounds asked for.
            row = list(map(str, key)) + cols + ["-", "-", "-", variant] + (["-"] if peak else []) + ["missing"]
            short += 1
        else:
            median = statistics.median(ratios)
            meets = median >= 1.0 and min(ratios) >= 0.97
            row = list(map(str, key)) + cols + [f"{median:.2f}", f"{statistics.median(mine):.1f}", f"{statistics.median(theirs):.1f}", variant]
            if peak:
                top = peak.get(f"{key[2]}_tflops", float("nan")) * 1e12
                row.append(f"{statistics.median(mine) * flops / top:.1%}")
            if slowed:
                # Slowed clocks move the ratio by more than the goal's margins, either way.
                row.append("throttled (" + "+".join(sorted(slowed)) + ")")
                unjudged += 1
            else:
                row.append("meets" if meets else "below")
                short += not meets
        out.append(row)
    print_table(head, out, markdown)
    met = len(cells) - short - unjudged
    print(f"\n{met} of {len(cells)} cells meet the goal (median ratio >= 1, every round >= 0.97)"
          + (f"; {unjudged} not judged: a side ran on slowed clocks (throttled) in some round" if unjudged else ""))


if __name__ == "__main__":
    main()
