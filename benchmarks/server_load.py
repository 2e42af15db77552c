"""Load on `powerinfer serve`: aggregate generated tokens/s with 1, 4, 8, 16 concurrent streams.

Starts the server on loopback (its own process, so the clients do not share its interpreter),
sends N simultaneous streaming /v1/completions requests (different prompts, greedy, a fixed number
of tokens each), and measures generated tokens over wall time, from the first request sent to the
last token received. Levels are interleaved over the repetitions so machine noise hits all alike;
the median repetition is reported.

    .venv/bin/python benchmarks/server_load.py                  # default model, 64 tokens per stream
    .venv/bin/python benchmarks/server_load.py --streams 1,8 --repetitions 5

Writes benchmarks/results/server_load.md (linked from docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from common import machine_description

RESULTS = Path(__file__).parent / "results" / "server_load.md"
TOPICS = ["a lighthouse keeper", "the history of bread", "how rivers form", "a robot learning to paint",
          "the rules of chess", "a city under the sea", "why the sky is blue", "a letter to a friend",
          "the life of bees", "a trip to the mountains", "the invention of the printing press", "a haunted library",
          "how vaccines work", "a day at the market", "the first steam engine", "a cat who became mayor"]


@dataclass
class Run:
    streams: int
    tokens: int
    seconds: float
    first_token_seconds: float  # mean time to first token

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "powerinfer.cli", "serve", "--port", "0", "--parallel", str(args.parallel),
               "-c", str(args.ctx)]
    command += ["-m", args.model] if args.model else []
    command += ["-t", str(args.threads)] if args.threads else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = server.stderr.readline()
    found = re.search(r"listening on (http://\S+)", first)
    if not found:
        server.kill()
        sys.exit(f"server did not start: {first.strip()}{server.stderr.read().strip()}")
    threading.Thread(target=server.stderr.read, daemon=True).start()  # drain the log
    url = found.group(1)
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/health").status_code != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            sys.exit("server failed to load the model")
        time.sleep(0.1)
    return server, url


async def stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, started: float) -> tuple[int, float]:
    """Generated tokens and time to the first one."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, generated = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
    return generated, first or 0.0


async def load(url: str, streams: int, tokens: int, offset: int) -> Run:
    # Story openings: greedy continuations that run past the token budget (no early end of text).
    prompts = [f"Here is a long story about {TOPICS[(offset + i) % len(TOPICS)]}. Once upon a time,"
               for i in range(streams)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams)) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, url, p, tokens, started) for p in prompts))
        seconds = time.perf_counter() - started
    return Run(streams, sum(n for n, _ in results), seconds, statistics.mean(t for _, t in results))


class OtherLoad:
    """The share of the machine's CPU time that processes other than this benchmark and its server
    used while it ran (the machine may be shared: their load slows the runs)."""

    def __init__(self, server_pid: int | None = None):
        self.pids = [os.getpid(), *([server_pid] if server_pid is not None else [])]
        self.start = self._sample()

    def _sample(self) -> tuple[int, int, int]:
        """(busy, total) jiffies of the machine, jiffies of our processes."""
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        ours = 0
        for pid in self.pids:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ours += sum(int(v) for v in stat[stat.rindex(")") + 2 :].split()[11:13])  # utime, stime
        return sum(fields) - fields[3] - fields[4], sum(fields), ours

    def share(self) -> float:
        busy, total, ours = (b - a for a, b in zip(self.start, self._sample()))
        return max(0, busy - ours) / total if total else 0.0


def write_table(runs: dict[int, Run], args: argparse.Namespace, model: str, other_load: float) -> str:

    base = runs[min(runs)].tokens_per_second
    lines = [
        "# Server load: aggregate generation speed with concurrent streams",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine_description()}; threads: {args.threads or 'default'}",
        f"- model: {model}; `powerinfer serve --parallel {args.parallel} -c {args.ctx}`",
        (f"- each stream: a different prompt, greedy, {args.tokens} tokens, streamed from /v1/completions; "
         f"median of {args.repetitions} repetitions (levels interleaved)"),
        f"- other processes used {other_load:.0%} of the machine's CPU time during the run",
        "- command: `.venv/bin/python benchmarks/server_load.py`",
        "",
        "| streams | tokens | wall s | aggregate tok/s | per stream tok/s | mean time to first token ms | vs 1 stream |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, run in sorted(runs.items()):
        lines.append(f"| {n} | {run.tokens} | {run.seconds:.2f} | {run.tokens_per_second:.1f} | "
                     f"{run.tokens_per_second / n:.1f} | {run.first_token_seconds * 1e3:.0f} | "
                     f"{run.tokens_per_second / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="GGUF file (default: the default model)")
    parser.add_argument("-t", "--threads", type=int, help="server threads (default: torch's choice)")
    parser.add_argument("--streams", default="1,4,8,16", help="concurrency levels (default: 1,4,8,16)")
    parser.add_argument("-n", "--tokens", type=int, default=64, help="tokens per stream (default: 64)")
    parser.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions of each level (default: 3)")
    parser.add_argument("--parallel", type=int, default=16, help="server slots (default: 16)")
    parser.add_argument("-c", "--ctx", type=int, default=512, help="server context per slot (default: 512)")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS, help=f"markdown file (default: {RESULTS})")
    args = parser.parse_args()
    levels = sorted({int(n) for n in args.streams.split(",")})

    server, url = start_server(args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(load(url, max(levels), 8, 0))  # warm-up
        other = OtherLoad(server.pid)
        samples: dict[int, list[Run]] = {n: [] for n in levels}
        for rep in range(args.repetitions):
            for n in levels:
                run = asyncio.run(load(url, n, args.tokens, rep))
                samples[n].append(run)
                print(f"rep {rep + 1}: {n:2d} streams {run.tokens:5d} tokens in {run.seconds:6.2f} s = "
                      f"{run.tokens_per_second:7.1f} tok/s", file=sys.stderr)
        other_load = other.share()
    finally:
        server.terminate()
        server.wait(timeout=30)
    runs = {n: sorted(rs, key=lambda r: r.tokens_per_second)[len(rs) // 2] for n, rs in samples.items()}
    table = write_table(runs, args, model, other_load)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
