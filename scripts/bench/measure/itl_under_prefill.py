"""Inter-token latency of running streams while long prompts arrive, through a real
`specdec serve` process (embedded model, native backend) and the official `openai` client.

`--streams` clients stream short completions back to back; once every stream is flowing,
`--long-prompts` requests of `--long-tokens` prompt tokens each (token ids, no two alike, so
no prefix cache helps) arrive `--stagger` seconds apart. The gaps between consecutive chunks
of a running stream are its inter-token latencies (a chunk is one decode step's tokens);
reported are their p50, p99 and max inside the window from the first long prompt's arrival
to the last one's answer, and over the whole run, plus each long prompt's time to its answer.

Run it with chunked prefill (the server's default) and with `--max-prefill-tokens 0`, which
prefills whole prompts when they are admitted (the behaviour before issue 16):

    python scripts/bench/measure/itl_under_prefill.py                          # chunked, 256 tokens a step
    python scripts/bench/measure/itl_under_prefill.py --max-prefill-tokens 0   # whole prompts

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import served  # noqa: E402 - scripts/bench/served.py

SHORT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a KV cache speeds up transformer decoding.",
    "List ten fruits and one fact about each.",
    "Describe the water cycle step by step.",
    "Write a poem about the sea in twelve lines.",
    "Explain the rules of chess to a child.",
    "Summarize the history of the printing press.",
    "Give a recipe for pancakes with exact amounts.",
]


def spawn(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    return served.spawn(["--target", args.target, "--backend", args.backend, "--drafter", args.drafter,
                         "--max-batch", str(args.streams + args.long_prompts),
                         "--max-prefill-tokens", str(args.max_prefill_tokens), "--served-model-name", "m",
                         *args.server_arg])


class Streams:
    """Clients that stream completions back to back until stopped; every chunk's arrival time."""

    def __init__(self, client: openai.OpenAI, count: int, max_tokens: int):
        self.client, self.max_tokens = client, max_tokens
        self.stopping = threading.Event()
        self.arrivals: list[list[list[float]]] = [[] for _ in range(count)]  # stream -> request -> times
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self.stopping.is_set():
            times: list[float] = []
            self.arrivals[i].append(times)
            prompt = f"{SHORT_PROMPTS[(i + n) % len(SHORT_PROMPTS)]} (take {n})"
            stream = self.client.completions.create(model="m", prompt=prompt, max_tokens=self.max_tokens,
                                                    temperature=0, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
            n += 1

    def flowing(self, chunks: int) -> bool:
        return all(sum(len(r) for r in reqs) >= chunks for reqs in self.arrivals)

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Inter-chunk gaps, in seconds, of gaps that end inside [start, end]."""
        return [b - a for reqs in self.arrivals for times in reqs for a, b in zip(times, times[1:], strict=False)
                if start <= b <= end]

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(300)


def percentiles(gaps: list[float]) -> dict:
    if len(gaps) < 2:
        return {"n": len(gaps)}
    cuts = statistics.quantiles(gaps, n=100, method="inclusive")
    return {"n": len(gaps), "p50_ms": round(1000 * cuts[49], 1), "p99_ms": round(1000 * cuts[98], 1),
            "max_ms": round(1000 * max(gaps), 1)}


def long_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]  # ordinary tokens of the embedded vocabulary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--backend", default="native")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--max-prefill-tokens", type=int, default=256, help="the server's flag; 0: whole prompts")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each streamed request")
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--stagger", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for `specdec serve`")
    args = p.parse_args()

    proc, url = spawn(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        rng = random.Random(0)
        client.completions.create(model="m", prompt=long_prompt(rng, args.long_tokens), max_tokens=1)  # warm-up
        streams = Streams(client, args.streams, args.stream_tokens)
        while not streams.flowing(5):
            time.sleep(0.05)
        answers: list[float] = []
        longs = [long_prompt(rng, args.long_tokens) for _ in range(args.long_prompts)]

        def send_long(ids: list[int]) -> None:
            t0 = time.perf_counter()
            client.completions.create(model="m", prompt=ids, max_tokens=1)
            answers.append(time.perf_counter() - t0)

        window_start = time.perf_counter()
        senders = []
        for i, ids in enumerate(longs):
            if i:
                time.sleep(args.stagger)
            senders.append(threading.Thread(target=send_long, args=(ids,)))
            senders[-1].start()
        for t in senders:
            t.join()
        window_end = time.perf_counter()
        time.sleep(1.0)  # some steady decoding after the window
        streams.stop()
    finally:
        proc.terminate()
        proc.wait(30)
    report = {
        "max_prefill_tokens": args.max_prefill_tokens, "backend": args.backend, "drafter": args.drafter,
        "streams": args.streams, "long_prompts": args.long_prompts, "long_tokens": args.long_tokens,
        "itl_during_long_prompts": percentiles(streams.gaps(window_start, window_end)),
        "itl_all": percentiles(streams.gaps()),
        "long_prompt_answer_s": [round(s, 2) for s in sorted(answers)],
    }
    window = report["itl_during_long_prompts"]
    print(f"max_prefill_tokens={args.max_prefill_tokens}: inter-token latency of {args.streams} streams while "
          f"{args.long_prompts} x {args.long_tokens}-token prompts arrive: p50 {window.get('p50_ms')} ms, "
          f"p99 {window.get('p99_ms')} ms, max {window.get('max_ms')} ms; long prompts answered in "
          f"{report['long_prompt_answer_s']} s", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
