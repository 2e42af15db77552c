"""Scale-out: aggregate tokens/s and p50/p95 latency of `powerinfer serve --ray` with 1, 2 and 4
replicas at a fixed offered load, and the cost of Ray's proxy and router against direct
`powerinfer serve` at 1 replica (target: within 10 % of its tokens/s).

Every configuration runs in its own server process; with --ray, the CLI starts its own local Ray
and stops it at the end. Each replica gets `--cores-per-replica` CPUs in Ray and as many threads;
the direct server gets the same threads. The load is an open loop: `--requests` streaming greedy
/v1/completions requests of `--tokens` tokens, sent at seeded Poisson arrivals of `--rate` per
second (the same schedule for every configuration) whether or not earlier ones have finished, so
a server that cannot keep up builds a queue instead of slowing the clients down. Aggregate
tokens/s = generated tokens / (first request sent .. last token received); latency = request sent
.. its last token; time to first token likewise. The median of `--repetitions` loads is reported.

    .venv/bin/python benchmarks/scale_out.py               # 1, 2, 4 replicas and direct serve: 16 cores or more
    .venv/bin/python benchmarks/scale_out.py --replicas 1 --cores-per-replica 2 --rate 2 --requests 24   # 2 cores

Writes benchmarks/results/scale_out.md (linked from docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from common import machine_description
from server_load import TOPICS, OtherLoad, stream

RESULTS = Path(__file__).parent / "results" / "scale_out.md"
START_SECONDS = 900  # a local Ray and its replicas on a loaded machine take minutes


@dataclass
class Load:
    tokens: int
    seconds: float
    latencies: list[float]
    first_tokens: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def latency(self, q: float) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q * 100) - 1]


class ProcessTreeLoad(OtherLoad):
    """OtherLoad counting the server's whole process tree as ours (Ray's processes descend from
    the CLI that started them)."""

    def __init__(self, server_pid: int):
        self.root = server_pid
        super().__init__(server_pid)

    def _sample(self) -> tuple[int, int, int]:
        self.pids = [os.getpid(), *descendants(self.root)]
        return super()._sample()


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):  # the process ended while we looked
            continue
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def start(command: list[str]) -> tuple[subprocess.Popen, str]:
    """A `powerinfer serve` process and its URL, once it answers /health with 200."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline, log = time.monotonic() + START_SECONDS, []
    while (line := server.stderr.readline()) and not (found := re.search(r"listening on (http://\S+)", line)):
        log.append(line)
        if time.monotonic() > deadline:
            break
    if not line or not found:
        stop(server)
        sys.exit(f"server did not start: {''.join(log[-5:]).strip()}")
    threading.Thread(target=server.stderr.read, daemon=True).start()  # drain the log
    url = found.group(1)
    while httpx.get(f"{url}/health", timeout=60).status_code != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            sys.exit("server failed to load the model")
        time.sleep(0.2)
    return server, url


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)  # the CLI removes its app and stops the Ray it started
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


async def offered_load(url: str, args: argparse.Namespace, repetition: int) -> Load:
    rng = random.Random(repetition)
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    prompts = [f"Here is a long story about {TOPICS[i % len(TOPICS)]}. Once upon a time," for i in range(args.requests)]

    async def one(client: httpx.AsyncClient, delay: float, prompt: str) -> tuple[int, float, float]:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        generated, first = await stream(client, url, prompt, args.tokens, sent)
        return generated, time.perf_counter() - sent, first

    delays = [sum(gaps[:i]) for i in range(args.requests)]
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=args.requests)) as client:
        began = time.perf_counter()
        results = await asyncio.gather(*(one(client, d, p) for d, p in zip(delays, prompts)))
        seconds = time.perf_counter() - began
    return Load(sum(n for n, _, _ in results), seconds, [t for _, t, _ in results], [f for _, _, f in results])


Config = tuple[str, int]  # (server, replicas)


def measure(commands: dict[Config, list[str]], args: argparse.Namespace) -> dict[Config, tuple[Load, float]]:
    """Per server: the median load over the repetitions, and the share of CPU time other processes
    used. The servers run side by side and take turns, so a busy spell of the machine falls on
    all of them alike (an idle server costs little: Ray's background work is a few per cent of a core)."""
    servers: dict[Config, tuple[subprocess.Popen, str]] = {}
    try:
        for config, command in commands.items():
            servers[config] = start(command)
        loads: dict[Config, list[Load]] = {config: [] for config in commands}
        shares: dict[Config, list[float]] = {config: [] for config in commands}
        for _, url in servers.values():
            asyncio.run(offered_load(url, argparse.Namespace(**{**vars(args), "tokens": 8}), 99))  # warm-up
        for repetition in range(args.repetitions):
            for config, (server, url) in servers.items():
                other = ProcessTreeLoad(server.pid)
                load = asyncio.run(offered_load(url, args, repetition))
                loads[config].append(load)
                shares[config].append(other.share())
                print(f"  {config[0]}, {config[1]} replica(s): {load.tokens} tokens in {load.seconds:.1f} s = "
                      f"{load.tokens_per_second:.1f} tok/s", file=sys.stderr)
    finally:
        for server, _ in servers.values():
            stop(server)
    return {config: (sorted(loads[config], key=lambda load: load.tokens_per_second)[len(loads[config]) // 2],
                     statistics.mean(shares[config])) for config in commands}


def serve_command(args: argparse.Namespace, replicas: int | None) -> list[str]:
    command = [sys.executable, "-m", "powerinfer.cli", "serve", "--port", "0", "--parallel", str(args.parallel),
               "-c", str(args.ctx), "-t", str(args.cores_per_replica)]
    command += ["-m", args.model] if args.model else []
    if replicas is not None:
        command += ["--ray", "--replicas", str(replicas), "--num-cpus", str(args.cores_per_replica)]
    return command


def write_table(rows: list[tuple[str, int, Load, float]], args: argparse.Namespace, model: str) -> str:
    offered = args.rate * args.tokens
    lines = [
        "# Scale-out: replicas behind Ray Serve at a fixed offered load",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine_description()}",
        f"- model: {model}; every server `--parallel {args.parallel} -c {args.ctx} -t {args.cores_per_replica}`; "
        f"Ray replicas `--num-cpus {args.cores_per_replica}` (one replica per {args.cores_per_replica} cores)",
        f"- load: {args.requests} streaming greedy /v1/completions requests of {args.tokens} tokens, Poisson arrivals at "
        f"{args.rate:g} requests/s (offered {offered:g} tok/s), the same schedule everywhere; median of "
        f"{args.repetitions} loads",
        f"- command: `.venv/bin/python {' '.join(['benchmarks/scale_out.py', *sys.argv[1:]])}`",
        "",
        "| server | replicas | aggregate tok/s | p50 latency s | p95 latency s | p50 time to first token s | "
        "other processes' CPU share |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, replicas, load, share in rows:
        lines.append(f"| {name} | {replicas} | {load.tokens_per_second:.1f} | {load.latency(0.5):.2f} | "
                     f"{load.latency(0.95):.2f} | {statistics.median(load.first_tokens):.2f} | {share:.0%} |")
    by_name = {(name, replicas): load for name, replicas, load, _ in rows}
    if ("direct serve", 1) in by_name and ("Ray Serve", 1) in by_name:
        direct, ray = by_name["direct serve", 1].tokens_per_second, by_name["Ray Serve", 1].tokens_per_second
        lines += ["", f"Ray's proxy and router at 1 replica: {ray:.1f} against {direct:.1f} tok/s direct, "
                      f"{(ray - direct) / direct:+.1%} (target: no worse than -10 %)."]
    missing = [n for n in (1, 2, 4) if ("Ray Serve", n) not in by_name]
    if missing:
        lines += ["", f"Not measured: {', '.join(map(str, missing))} replica(s). At one replica per "
                      f"{args.cores_per_replica} cores, 4 replicas need {4 * args.cores_per_replica} cores; "
                      f"this machine has {os.cpu_count()}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="GGUF file (default: the default model)")
    parser.add_argument("--replicas", default="1,2,4", help="replica counts under Ray (default: 1,2,4)")
    parser.add_argument("--cores-per-replica", type=int, default=4, help="CPUs and threads per replica (default: 4)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second offered (default: 8)")
    parser.add_argument("--requests", type=int, default=96, help="requests per load (default: 96)")
    parser.add_argument("-n", "--tokens", type=int, default=64, help="tokens per request (default: 64)")
    parser.add_argument("-r", "--repetitions", type=int, default=3, help="loads per configuration (default: 3)")
    parser.add_argument("--parallel", type=int, default=8, help="slots per server or replica (default: 8)")
    parser.add_argument("-c", "--ctx", type=int, default=512, help="context per slot (default: 512)")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS, help=f"markdown file (default: {RESULTS})")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.replicas.split(",")})
    if max(counts) * args.cores_per_replica > (os.cpu_count() or 1):
        print(f"warning: {max(counts)} replicas of {args.cores_per_replica} cores need "
              f"{max(counts) * args.cores_per_replica} cores; this machine has {os.cpu_count()}", file=sys.stderr)

    # Direct serve and 1 replica side by side (the router's cost), then each larger count alone.
    groups = [{("direct serve", 1): serve_command(args, None), ("Ray Serve", 1): serve_command(args, 1)}] if 1 in counts else []
    groups += [{("Ray Serve", n): serve_command(args, n)} for n in counts if n != 1]
    rows = []
    for group in groups:
        rows += [(name, n, load, share) for (name, n), (load, share) in measure(group, args).items()]
    model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct Q4_1 (default)"
    table = write_table(rows, args, model)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
