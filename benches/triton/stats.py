"""Triton's own account of the requests it served between two snapshots of its statistics
extension (GET /v2/models/<model>/stats): per request, the time from receiving it to sending its
answer, and within it the queue, the input copy, the inference and the output copy, in ms. Beside a
client's latency it says how much of that latency the server spent and how much the transport did.

    python stats.py --model resnet50 snapshot /tmp/before.json
    python stats.py --model resnet50 since /tmp/before.json --label migprof
"""

import argparse
import json
import urllib.request

PARTS = ["success", "queue", "compute_input", "compute_infer", "compute_output"]


def read(url, model, token):
    request = urllib.request.Request(f"{url}/v2/models/{model}/stats", headers={"triton-access-token": token})
    with urllib.request.urlopen(request, timeout=10) as answer:
        stats = json.load(answer)["model_stats"][0]["inference_stats"]
    return {part: (int(stats[part]["count"]), int(stats[part]["ns"])) for part in PARTS}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--token", default="migprof-bench")
    parser.add_argument("what", choices=["snapshot", "since"])
    parser.add_argument("file")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    now = read(args.url, args.model, args.token)
    if args.what == "snapshot":
        with open(args.file, "w") as f:
            json.dump(now, f)
        return
    with open(args.file) as f:
        before = json.load(f)
    requests = now["success"][0] - before["success"][0]
    if requests <= 0:
        print(f"{args.label}: no request served since the snapshot")
        return
    ms = {part: (now[part][1] - before[part][1]) / requests / 1e6 for part in PARTS}
    print(
        f"{args.label}: {requests} requests; server per request {ms['success']:.2f} ms "
        f"(queue {ms['queue']:.2f}, input {ms['compute_input']:.2f}, infer {ms['compute_infer']:.2f}, "
        f"output {ms['compute_output']:.2f})"
    )


if __name__ == "__main__":
    main()
