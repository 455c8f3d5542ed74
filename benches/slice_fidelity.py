"""The slice study's tables from a results folder (benches/gpu_run.sh fidelity): per model and batch,
each profile's throughput as a fraction of the whole GPU's, emulated alone (mps:) and with its memory
partitioned (mps-mem:), beside its share of the SMs and of the memory and the published real-MIG
points (data/mig/reference.json); then what each partitioned client measured of itself.

    python3 benches/slice_fidelity.py RESULTS_DIR [RESULTS_DIR ...]

Where folders hold the same cell on the same target kind and GPU more than once, the latest row
counts. A slice's fraction is of the whole GPU it was emulated on (a sweep over two GPUs has a whole
GPU target on each).
"""

import json
import pathlib
import sys

import pyarrow.parquet as pq

MEMORY_SLICES = {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4, "4g.40gb": 4, "7g.80gb": 8}
ORDER = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def latest(folders):
    """The ok rows of every folder, the latest per model, batch, GPU, device and memory emulation."""
    best = {}
    for folder in folders:
        for r in pq.read_table(f"{folder}/runs").to_pylist():
            if r["status"] not in (None, "ok"):
                continue
            key = (r["model"], r["batch"], r["gpu_uuid"], r["device_kind"], r["emulated_profile"],
                   r["memory_emulation"])
            if key not in best or best[key]["started_at"] < r["started_at"]:
                best[key] = r
    return list(best.values())


def main(folders):
    rows = latest(folders)
    full_on = {(r["gpu_uuid"], r["model"], r["batch"]): r["throughput"] for r in rows if r["device_kind"] == "cuda"}
    full = {}
    for (_, model, batch), t in sorted(full_on.items()):
        full.setdefault((model, batch), t)

    def fraction(r):
        base = full_on.get((r["gpu_uuid"], r["model"], r["batch"])) or full[(r["model"], r["batch"])]
        return r["throughput"] / base

    emulated = {}
    for r in rows:
        if r["emulated_profile"]:
            emulated[(r["model"], r["batch"], r["emulated_profile"], r["memory_emulation"])] = r
    gpu_sms = next((r["sm_count"] for r in rows if r["device_kind"] == "cuda"), 132)
    reference = json.loads((pathlib.Path(__file__).parent.parent / "data/mig/reference.json").read_text())["points"]

    print("Fraction of the whole GPU's throughput: alone (mps:) .. partitioned (mps-mem:); SM and memory shares")
    print(f"{'model':<10} {'batch':>5} {'full /s':>9}  " + "  ".join(f"{p:>15}" for p in ORDER))
    for (model, batch), base in sorted(full.items()):
        cells = []
        for p in ORDER:
            a = emulated.get((model, batch, p, "alone"))
            m = emulated.get((model, batch, p, "partitioned"))
            fa = f"{fraction(a):.3f}" if a else "  -  "
            fm = f"{fraction(m):.3f}" if m else "  -  "
            cells.append(f"{fa:>6} .. {fm:<6}")
        print(f"{model:<10} {batch:>5} {base:>9.1f}  " + "  ".join(f"{c:>15}" for c in cells))
    shares = []
    for p in ORDER:
        sms = next((r["profile_sms"] for r in rows if r["emulated_profile"] == p), None)
        sm = "  -  " if sms is None else f"{sms / gpu_sms:.3f}"
        shares.append(f"{sm} / {MEMORY_SLICES[p] / 8:.3f}")
    print(f"{'SMs / memory':<27}  " + "  ".join(f"{s:>15}" for s in shares))
    gpus = sorted({r["gpu_uuid"] for r in rows if r["gpu_uuid"]})
    if len(gpus) > 1:
        print("GPUs: " + "; ".join(
            f"{g[:12]}: " + ", ".join(sorted({r['target'] for r in rows if r['gpu_uuid'] == g and r['target']}))
            for g in gpus))
    print()
    print("Every partitioned cell: the client's bandwidth beside its neighbour over its share, the neighbour's setting")
    print(f"{'profile':<9} {'cells':>5} {'outcomes':<48} {'bandwidth / share':>17} {'blocks':>9} {'pause ns':>11}")
    for p in ORDER:
        cells = [r for r in rows if r["emulated_profile"] == p and r["memory_emulation"] == "partitioned"]
        if not cells:
            continue
        outcomes = {}
        for r in cells:
            outcomes[r["calibration"]] = outcomes.get(r["calibration"], 0) + 1
        ratios = [r["measured_bandwidth_gbps"] / r["memory_share_gbps"] for r in cells
                  if r["measured_bandwidth_gbps"] and r["memory_share_gbps"]]
        span = lambda vs, f: "-" if not vs else (format(min(vs), f) + "-" + format(max(vs), f))
        blocks = [r["neighbour_blocks"] for r in cells if r.get("neighbour_blocks") is not None]
        pauses = [r["neighbour_pause_ns"] for r in cells if r["neighbour_pause_ns"] is not None]
        said = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items(), key=lambda kv: str(kv[0])))
        print(f"{p:<9} {len(cells):>5} {said:<48} {span(ratios, '.2f'):>17} {span(blocks, 'd'):>9} {span(pauses, 'd'):>11}")
    print()
    print("Published real-MIG points (another GPU):")
    for pt in reference:
        print(f"  {pt['gpu']} {pt['profile']} vs {pt['baseline']}: {pt['model']} batch {pt['batch']}: "
              f"{pt['relative_throughput']:.3f} ({pt['setting']})")
    print()
    print("What each partitioned client measured (first cell of each profile):")
    print(f"{'profile':<9} {'GPU GB/s':>8} {'share':>6} {'alone':>6} {'beside':>6} {'blocks':>6} {'pause ns':>8} "
          f"{'outcome':<19} {'cached':<6} {'nbr SMs':>7} {'shared':>6} {'compute %':>9} {'L2 MiB':>6} {'clock':>5}")
    seen = set()
    for r in sorted(rows, key=lambda r: (r["emulated_profile"] or "", r["started_at"])):
        p = r["emulated_profile"]
        if not p or (p, r["memory_emulation"]) in seen:
            continue
        seen.add((p, r["memory_emulation"]))
        if r["memory_emulation"] != "partitioned":
            l2 = r["measured_l2_mib"]
            print(f"{p:<9} {'':>8} {'':>6} {r['measured_bandwidth_gbps'] or 0:>6.0f} {'':>6} {'':>6} {'':>8} {'alone':<19} "
                  f"{'':<6} {'':>7} {'':>6} {'':>9} {'-' if l2 is None else f'{l2:.1f}':>6}")
            continue
        fmt = lambda v, f: "-" if v is None else format(v, f)
        print(f"{p:<9} {fmt(r['gpu_bandwidth_gbps'], '.0f'):>8} {fmt(r['memory_share_gbps'], '.0f'):>6} "
              f"{fmt(r['alone_bandwidth_gbps'], '.0f'):>6} {fmt(r['measured_bandwidth_gbps'], '.0f'):>6} "
              f"{fmt(r.get('neighbour_blocks'), 'd'):>6} {fmt(r['neighbour_pause_ns'], 'd'):>8} {r['calibration'] or '-':<19} {str(r['calibration_cached']):<6} "
              f"{fmt(r['neighbour_sms'], 'd'):>7} {fmt(r['shared_sms'], 'd'):>6} {fmt(r['compute_slowdown_pct'], '.1f'):>9} "
              f"{fmt(r['measured_l2_mib'], '.1f'):>6} {fmt(r['calibration_sm_clock_mhz'], 'd'):>5}")


if __name__ == "__main__":
    main(sys.argv[1:])
