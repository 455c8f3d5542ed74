#!/usr/bin/env python3
"""Compare `migprof profiles` with `nvidia-smi mig -lgip` and `-lgipp`, field by field.

    python3 scripts/check_mig_profiles.py MIGPROF_PROFILES.txt LGIP.txt LGIPP.txt

Each profile must appear in both with the same id, instance total, memory (GiB, two decimals), SMs,
copy engines, decoders, encoders, JPEG and OFA engines, and the same placements. Exits 1 listing
every difference. Works on live output (benches/gpu_run.sh mig) and on the recordings in data/mig/.
"""
import re
import sys


def nvidia_smi(lgip_text, lgipp_text):
    profiles = {}
    lines = lgip_text.splitlines()
    row = re.compile(r"\|\s+\d+\s+MIG\s+(\S+)\s+(\d+)\s+\d+/(\d+)\s+([\d.]+)\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+\|")
    second = re.compile(r"\|\s+(\d+)\s+(\d+)\s+(\d+)\s+\|")
    for i, line in enumerate(lines):
        m = row.match(line)
        if not m:
            continue
        name, pid, total, gib, sm, dec, enc = m.groups()
        m2 = second.match(lines[i + 1])
        if not m2:
            sys.exit(f"cannot read the engine line after: {line}")
        ce, jpeg, ofa = m2.groups()
        profiles[name] = dict(id=int(pid), instances=int(total), gib=f"{float(gib):.2f}", sm=int(sm), ce=int(ce),
                              dec=int(dec), enc=int(enc), jpeg=int(jpeg), ofa=int(ofa))
    by_id = {p["id"]: name for name, p in profiles.items()}
    for line in lgipp_text.splitlines():
        m = re.match(r"GPU\s+\d+\s+Profile ID\s+(\d+)\s+Placements?\s*:\s*(\{[\d,]*\}:\d+)", line)
        if m:
            profiles[by_id[int(m.group(1))]]["placements"] = m.group(2)
    return profiles


def migprof(text):
    profiles = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) != 11 or not f[1].isdigit():
            continue
        name, pid, total, gib, sm, ce, dec, enc, jpeg, ofa, placements = f
        profiles[name] = dict(id=int(pid), instances=int(total), gib=gib, sm=int(sm), ce=int(ce), dec=int(dec),
                              enc=int(enc), jpeg=int(jpeg), ofa=int(ofa), placements=placements)
    return profiles


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    ours = migprof(open(sys.argv[1]).read())
    theirs = nvidia_smi(open(sys.argv[2]).read(), open(sys.argv[3]).read())
    problems = []
    if not theirs:
        problems.append("no profiles in the nvidia-smi listing")
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours or name not in theirs:
            problems.append(f"{name}: only in {'migprof' if name in ours else 'nvidia-smi'}")
            continue
        for key, want in theirs[name].items():
            if ours[name].get(key) != want:
                problems.append(f"{name}: {key} migprof {ours[name].get(key)} vs nvidia-smi {want}")
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(f"{len(ours)} profiles agree with nvidia-smi (id, instances, GiB, SMs, CE, DEC, ENC, JPEG, OFA, placements)")


if __name__ == "__main__":
    main()
