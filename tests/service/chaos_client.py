"""A client process for the chaos test: streams greedy requests from several threads until its
time is up, cancels every tenth one after its first delta, and writes one outcome per request
to a JSON file.

    python -m tests.service.chaos_client URL OUT_JSON SECONDS SEED
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time

from nanovllm_client import Client, EngineDeadError, RequestError

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):\n    ", "Hello, world",
           "for i in range(10):", "# 中文 😀 comment\n"]
MAX_TOKENS = (24, 40, 64)
THREADS = 6


def one_request(client: Client, index: int, rng: random.Random) -> dict:
    prompt, max_tokens = rng.randrange(len(PROMPTS)), rng.choice(MAX_TOKENS)
    outcome = {"index": index, "prompt": prompt, "max_tokens": max_tokens, "started": time.time()}
    try:
        stream = client.stream(PROMPTS[prompt], max_tokens=max_tokens, temperature=0, ignore_eos=True)
        deltas = []
        for delta in stream:
            deltas.append(delta)
            if index % 10 == 0:
                stream.cancel()
                outcome["kind"] = "cancelled"
                break
        else:
            outcome.update(kind="done", finish_reason=deltas[-1].finish_reason)
        outcome.update(text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
                       terminals=sum(d.finished for d in deltas))
    except EngineDeadError as e:
        outcome.update(kind="engine_dead", error=str(e))
    except RequestError as e:
        outcome.update(kind="error", error=str(e))
    outcome["ended"] = time.time()
    return outcome


def main(url: str, out_path: str, seconds: float, seed: int) -> None:
    outcomes: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    deadline = time.monotonic() + seconds

    def worker(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        while time.monotonic() < deadline:
            with lock:
                index = next(counter)
            outcome = one_request(client, index, rng)
            with lock:
                outcomes.append(outcome)
            if outcome["kind"] == "engine_dead":
                time.sleep(0.2)  # the engine is down: do not spin

    with Client(url, timeout=120, connect_timeout=60) as client:
        client.wait_engine(timeout=60)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with open(out_path, "w") as f:
        json.dump(outcomes, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
