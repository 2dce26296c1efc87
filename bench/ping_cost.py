"""What one client ping costs each stage: sent one at a time (each wakes the stage on its own, as
64 clients' unaligned heartbeats do) or in a burst (one wake-up serves many).

    python bench/ping_cost.py [--pings 2000]

Starts the tiny-model service (bench/serve.py's `Service`), sends the pings from a raw DEALER,
and prints the stage's CPU (from /proc) and this process's per ping, as a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.serve import Service, build_tiny_model  # noqa: E402
from nanovllm_client import protocol as p  # noqa: E402
from nanovllm_client.endpoints import service_endpoints  # noqa: E402


def ping_cost(service: Service, stage: str, endpoint: str, pings: int, paced: bool) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        before, own = service.cpu_seconds()[stage], time.process_time()
        for _ in range(pings):
            sock.send(p.Ping().encode())
            if paced:
                sock.recv()
        if not paced:
            for _ in range(pings):
                sock.recv()
        stage_s, own = service.cpu_seconds()[stage] - before, time.process_time() - own
    finally:
        ctx.destroy(linger=0)
    return {"stage": stage, "paced": paced, "stage_us_per_ping": round(stage_s / pings * 1e6),
            "pinger_us_per_ping": round(own / pings * 1e6)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pings", type=int, default=2000)
    args = parser.parse_args()
    model = build_tiny_model(os.path.join(tempfile.gettempdir(), "nanovllm-bench-tiny"))
    with Service(model, ["--max-num-seqs", "64"]) as service:
        time.sleep(3)  # the engine's background start-up work is over
        eps = service_endpoints(service.url)
        rows = [ping_cost(service, stage, endpoint, args.pings, paced)
                for stage, endpoint in (("tokenizer_proc", eps.tokenizer), ("detok_proc", eps.stream))
                for paced in (True, False)]
    print(f"\n{'stage':16}{'pings':>8}{'stage us/ping':>16}{'pinger us/ping':>16}")
    for row in rows:
        print(f"{row['stage']:16}{'alone' if row['paced'] else 'burst':>8}"
              f"{row['stage_us_per_ping']:16d}{row['pinger_us_per_ping']:16d}")
    print(json.dumps({"pings": args.pings, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
