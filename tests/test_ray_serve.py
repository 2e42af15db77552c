"""`powerinfer serve --ray`: replicas of the server behind Ray Serve, on one local Ray (127.0.0.1)
shared by the module's Ray tests: answers equal to LLM.generate from both replicas, a replica
killed under load, requests that arrive before any replica is healthy. Without Ray: the replica
name on answers and metrics, and the proxy middleware's answers for replicas that died."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from powerinfer.cli import parse_args
from powerinfer.commands.serve import serve_settings
from powerinfer.server.app import create_app
from powerinfer.server.ray_proxy import ReplicaFailureAnswers
from powerinfer.server.replica import REPLICA_HEADER, label_series
from powerinfer.server.startup import listen

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'powerinfer[ray]')")

PROMPTS = [f"{subject} is" for subject in (
    "The capital of France", "Water", "A good breakfast", "The tallest mountain", "Python", "The moon",
    "My favourite colour", "The first computer", "A triangle", "Winter", "The ocean", "Music",
    "The best way to learn", "A cat", "The year 1492", "Coffee")]
MAX_TOKENS = 12
REPLICA_PROCESS = b"ray::ServeReplica:powerinfer:"  # Ray names a replica's process after app and deployment


def serve_args(model: Path, *extra: str):
    # One thread per replica and half a CPU each: two replicas, a restarted one and a late one fit
    # in Ray's count of this machine's cores.
    return parse_args(["serve", "--ray", "-m", str(model), "-t", "1", "--num-cpus", "0.5", "-c", "512",
                       "--port", "0", *extra])


@pytest.fixture(scope="module")
def ray_url(default_model) -> Iterator[str]:
    from powerinfer.server import ray_app

    started = ray_app.connect(None)
    from ray import serve

    args = serve_args(default_model, "--replicas", "2")
    try:
        yield ray_app.deploy(args, serve_settings(args), ray_app.deployment_options(args))
    finally:
        serve.shutdown()
        if started:
            ray_app.import_ray(None).shutdown()


@pytest.fixture(scope="module")
def client(ray_url) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="none", max_retries=0, timeout=60)
    client.model_id = client.models.list().data[0].id
    return client


@pytest.fixture(scope="module")
def expected(default_llm) -> dict[str, str]:
    return {p: default_llm.generate(p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS}


def complete(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    """(text, replica) of one greedy completion."""
    raw = client.completions.with_raw_response.create(model=client.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0)
    return raw.parse().choices[0].text, raw.headers["x-powerinfer-replica"]


def replica_names(client: openai.OpenAI, n: int = 16) -> set[str]:
    with ThreadPoolExecutor(8) as pool:
        return {replica for _, replica in pool.map(lambda p: complete(client, p), PROMPTS[:n])}


def replica_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(REPLICA_PROCESS):
                pids.append(int(entry.name))
        except OSError:  # the process ended while we looked
            continue
    return pids


def running_replicas(app: str = "powerinfer") -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    return 0 if status is None else sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


@pytest.mark.slow
@needs_ray
def test_two_replicas_answer_like_generate(client, ray_url, expected):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(client, p), PROMPTS))
    assert [text for text, _ in answers] == [expected[p] for p in PROMPTS]
    assert len({replica for _, replica in answers}) == 2, "Ray's router used one replica for 16 concurrent requests"
    # Streams, /health and errors name their replica too; /metrics labels its series with it.
    with client.completions.with_streaming_response.create(model=client.model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                           temperature=0, stream=True) as stream:
        assert stream.headers["x-powerinfer-replica"] in {replica for _, replica in answers}
        assert "".join(chunk.choices[0].text for chunk in stream.parse()) == expected[PROMPTS[0]]
    health = httpx.get(f"{ray_url}/health")
    assert health.status_code == 200 and health.headers["x-powerinfer-replica"]
    # (any model name is served, as llama-server does: an error needs a bad field)
    refused = httpx.post(f"{ray_url}/v1/completions", json={"prompt": "x", "max_tokens": -5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert refused.headers["x-powerinfer-replica"]
    metrics = httpx.get(f"{ray_url}/metrics")
    replica = metrics.headers["x-powerinfer-replica"]
    samples = [line for line in metrics.text.splitlines() if line.startswith("powerinfer_")]
    assert samples and all(f'{{replica="{replica}"' in line for line in samples)


@pytest.mark.slow
@needs_ray
def test_killed_replica_under_load(client, expected):
    before = replica_names(client)
    assert len(before) == 2 and len(replica_pids()) == 2
    first_token = threading.Event()
    outcomes: list[str] = []

    def request(i: int) -> str:
        prompt, started = PROMPTS[i % len(PROMPTS)], time.monotonic()
        try:
            if i % 2:  # streams: some will be cut part-way
                text = ""
                for chunk in client.completions.create(model=client.model_id, prompt=prompt, max_tokens=48, temperature=0,
                                                       stream=True):
                    first_token.set()
                    text += chunk.choices[0].text
                outcome = "answer"
            else:
                text = client.completions.create(model=client.model_id, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
                outcome = "answer"
            assert text.startswith(expected[prompt])
        except openai.APIStatusError as error:  # a 5xx with OpenAI's body
            assert error.status_code >= 500 and error.type == "unavailable_error", error
            outcome = "error"
        except openai.APIError as error:  # an error event that ended a stream
            assert error.type == "unavailable_error", error
            outcome = "error"
        assert time.monotonic() - started < 60, f"request {i} took {time.monotonic() - started:.0f} s"
        return outcome

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(request, i) for i in range(32)]
        assert first_token.wait(60), "no stream started"
        os.kill(replica_pids()[0], signal.SIGKILL)
        outcomes = [future.result(timeout=90) for future in futures]
    assert outcomes.count("answer") >= 16, outcomes  # the live replica and the retries answered most
    # Later requests succeed, and Ray brings the replica count back to 2 with a new replica.
    assert all(text == expected[p] for text, p in ((complete(client, p)[0], p) for p in PROMPTS[:4]))
    deadline = time.monotonic() + 120
    while running_replicas() < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    # Serve's status says RUNNING before every router has the new replica: ask until both answer.
    after: set[str] = set()
    while len(after) < 2 and time.monotonic() < deadline + 60:
        after |= replica_names(client)
    assert len(after) == 2 and len(after - before) == 1 and len(replica_pids()) == 2, (before, after)


@pytest.mark.slow
@needs_ray
def test_request_before_any_replica_is_healthy(ray_url, default_model, expected):
    from ray import serve

    from powerinfer.server import ray_app

    args = serve_args(default_model, "--replicas", "1")
    replica = ray_app.replica_deployment(*ray_app.prepare(args, serve_settings(args)))
    app = replica.options(**ray_app.deployment_options(args), name="late").bind()
    deploying = threading.Thread(target=serve.run, args=(app,), kwargs=dict(name="late", route_prefix="/late"))
    deploying.start()
    try:
        deadline = time.monotonic() + 60
        while "/late" not in httpx.get(f"{ray_url}/-/routes").json():  # Ray's proxy has the route: requests reach the router
            assert time.monotonic() < deadline, "the late app's route never appeared"
            time.sleep(0.05)
        assert running_replicas("late") == 0, "the replica was healthy before the first request; nothing was tested"
        with ThreadPoolExecutor(2) as pool:
            health = pool.submit(httpx.get, f"{ray_url}/late/health", timeout=120)
            answer = pool.submit(httpx.post, f"{ray_url}/late/v1/completions", timeout=120,
                                 json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
            health, answer = health.result(), answer.result()
        for response in (health, answer):
            assert response.status_code in (200, 503), response.text
            if response.status_code == 503:
                assert response.json()["error"]["type"] == "unavailable_error"
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["text"] == expected[PROMPTS[0]]
    finally:
        deploying.join(timeout=180)
        serve.delete("late")


# --- without Ray -------------------------------------------------------------------------------

def test_replica_name_on_answers_and_metrics(default_llm):
    parser = pytest.importorskip("prometheus_client.parser")
    name = 'powerinfer#a"b\\nc'  # quotes and backslashes must survive the label's escaping
    with TestClient(create_app(default_llm, replica=name)) as client:
        for response in (client.get("/health"), client.get("/no-such-route"), client.post("/tokenize", content=b"{")):
            assert response.headers[REPLICA_HEADER] == name
        samples = [s for family in parser.text_string_to_metric_families(client.get("/metrics").text)
                   for s in family.samples]
    assert samples and all(sample.labels["replica"] == name for sample in samples)
    assert all(set(sample.labels) == {"replica", "le"} for sample in samples if sample.name.endswith("_bucket"))
    with TestClient(create_app(default_llm)) as client:
        assert REPLICA_HEADER not in client.get("/health").headers
        assert 'replica="' not in client.get("/metrics").text


def test_label_series_keeps_other_labels():
    parser = pytest.importorskip("prometheus_client.parser")
    text = '# HELP a_total A.\n# TYPE a_total counter\na_total{kind="x",n="1"} 2\nb 3.5 1700000000\nc{} 4\n'
    samples = [s for family in parser.text_string_to_metric_families(label_series(text, "replica", "r1"))
               for s in family.samples]
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("a_total", {"replica": "r1", "kind": "x", "n": "1"}, 2.0), ("b", {"replica": "r1"}, 3.5),
        ("c", {"replica": "r1"}, 4.0)]


class FakeProxy:
    """Ray's proxy as ReplicaFailureAnswers sees it: each call plays the next script, an ASGI
    behaviour given the request body it read."""

    def __init__(self, *scripts):
        self.scripts, self.bodies = list(scripts), []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        await self.scripts.pop(0)(send)


def died_before_answering():
    async def script(send):
        return None  # what Ray's proxy does when the replica's actor died: no response at all
    return script


def replica_answer(body: bytes, content_type: bytes = b"application/json", more: list[bytes] = (), ends: bool = True):
    async def script(send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (REPLICA_HEADER.encode(), b"r1")]})
        for part in (body, *more):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        if ends:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    return script


def proxy_refusal(status: int, text: bytes):
    async def script(send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"2")]})
        await send({"type": "http.response.body", "body": text, "more_body": False})
    return script


def through_proxy(proxy: FakeProxy) -> httpx.Response:
    return TestClient(ReplicaFailureAnswers(proxy)).post("/v1/completions", content=b'{"prompt": "hi"}')


def test_proxy_retries_a_request_whose_replica_died():
    proxy = FakeProxy(died_before_answering(), replica_answer(b'{"ok": true}'))
    response = through_proxy(proxy)
    assert response.status_code == 200 and response.json() == {"ok": True}
    assert proxy.bodies == [b'{"prompt": "hi"}'] * 2  # the retry got the same body


def test_proxy_answers_503_when_the_retry_fails_too():
    response = through_proxy(FakeProxy(died_before_answering(), died_before_answering()))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = openai.OpenAI(api_key="x")._make_status_error_from_response(response)  # the openai client's reading
    assert isinstance(error, openai.InternalServerError) and error.type == "unavailable_error"


def test_proxy_ends_a_cut_stream_with_an_error_event():
    proxy = FakeProxy(replica_answer(b'data: {"choices": []}\n\n', b"text/event-stream", ends=False))
    response = through_proxy(proxy)
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and len(events) == 2
    assert '"type": "unavailable_error"' in events[1]


def test_proxy_refusals_get_openai_bodies_and_replica_answers_pass():
    refused = through_proxy(FakeProxy(proxy_refusal(503, b"Deployment 'powerinfer' is unavailable.")))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"] == {"message": "Deployment 'powerinfer' is unavailable.", "type": "unavailable_error",
                                       "param": None, "code": None}
    passed = through_proxy(FakeProxy(replica_answer(b'{"a": ', more=[b"1}"])))
    assert passed.json() == {"a": 1} and passed.headers[REPLICA_HEADER] == "r1"


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "--replicas fixes the count"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --min-replicas 3"),
    (["--ray", "--vram-budget", "4"], "--vram-budget with --ray needs --num-gpus"),
    (["--ray"], "--ray needs the 'ray' extra"),  # with ray made unimportable below
])
def test_serve_ray_flags_refused_in_one_line(argv, message, capsys, monkeypatch):
    from powerinfer.cli import main
    from powerinfer.server import ray_app

    monkeypatch.setitem(sys.modules, "ray", None)  # bad flags are refused before Ray is needed
    monkeypatch.setenv(ray_app.LOCAL_ONLY_VARIABLE, "0")  # restored afterwards, whatever serve sets
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


# --- the CLI's Ray lifetime: a private Ray by default, our application removed from a cluster --------

APPLICATIONS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
named = ray.util.list_named_actors(all_namespaces=True)
print(json.dumps(sorted(serve.status().applications) if any(a["namespace"] == "serve" for a in named) else []))
"""


# Token authentication, Ray's default for a cluster `ray start` starts: its clients must ask for it
# too (this process has it set only once its own Ray has started).
CLUSTER_AUTH = {"RAY_AUTH_MODE": "token"}


def applications_on(address: str) -> list[str]:
    """The Serve applications running on the Ray cluster at `address` (asked from a child process:
    this one may be connected to another Ray)."""
    result = subprocess.run([sys.executable, "-c", APPLICATIONS, address], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **CLUSTER_AUTH})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def descendants(pid: int) -> set[int]:
    """Processes below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def processes_using(folder: Path) -> list[int]:
    """Live processes whose command line names `folder` or that hold a file under it open: Ray's
    agents rewrite their command lines but keep their logs in the session's folder open."""
    prefix, found = f"{folder}/", []
    in_arguments = re.compile(re.escape(str(folder).encode()) + rb"(?=/|\0|$)")  # not a longer name
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            named = in_arguments.search((entry / "cmdline").read_bytes())
            if named or any(os.readlink(fd).startswith(prefix) for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:  # ended while we looked, or not ours to read
            continue
    return found


def kill_processes_using(folder: Path) -> None:
    """SIGKILL to the processes of the Ray whose files are in `folder`, until none is left (its
    raylet may start one while the others are killed)."""
    deadline = time.monotonic() + 30
    while pids := processes_using(folder):
        assert time.monotonic() < deadline, f"processes outlived SIGKILL: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def other_cluster(tmp_path_factory) -> Iterator[str]:
    """A Ray cluster already running on this machine (`ray start --head`), as an operator's would be."""
    temp = tmp_path_factory.mktemp("ray")
    ray_cli = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
    with listen("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    # without the RAY_ADDRESS this process's own Ray (the module's) may have set
    environment = {**{name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}, **CLUSTER_AUTH}
    started = subprocess.run([*ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                              "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", str(temp)],
                             capture_output=True, text=True, timeout=180, env=environment)
    assert started.returncode == 0, started.stderr
    try:
        yield address
    finally:
        kill_processes_using(temp)  # only this cluster's: `ray stop` would stop every Ray on the machine


def serve_on_ray_command(model: Path, *extra: str, env: dict) -> tuple[subprocess.Popen, str]:
    """`powerinfer serve --ray` in a child process, and its URL once it serves."""
    process = subprocess.Popen([sys.executable, "-m", "powerinfer.cli", "serve", "--ray", "-m", str(model), "-t", "1",
                                "--num-cpus", "0.5", "-c", "256", "--port", "0", *extra],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in process.stderr:
        if match := re.search(r"listening on (http://\S+)", line):
            return process, match.group(1)
        lines.append(line)
    raise AssertionError(f"serve --ray exited with {process.wait()} before listening: {lines[-3:]}")


@pytest.mark.slow
@needs_ray
def test_serve_ray_without_address_starts_a_private_ray_that_dies_with_it(default_model, other_cluster,
                                                                          tmp_path_factory):
    # Ray's own default would join the cluster RAY_ADDRESS names (or the last `ray start`'s). The
    # private Ray keeps its session under RAY_TMPDIR (a short path: Ray's sockets live there).
    ray_temp = tmp_path_factory.mktemp("rt")
    process, url = serve_on_ray_command(default_model, env={"RAY_ADDRESS": other_cluster, "RAY_TMPDIR": str(ray_temp)})
    try:
        answer = httpx.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert applications_on(other_cluster) == []  # nothing of ours on the cluster already running
        ours = descendants(process.pid)
        assert ours, "the private Ray's processes were not started by the command"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
        deadline = time.monotonic() + 60
        # its children, and any process of its Ray that left the family (a daemon)
        while left := [pid for pid in ours if alive(pid)] + processes_using(ray_temp):
            assert time.monotonic() < deadline, f"Ray processes outlived the command: {left}"
            time.sleep(0.2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        kill_processes_using(ray_temp)  # after a failure: its Ray outlives a SIGKILL


@pytest.mark.slow
@needs_ray
def test_serve_ray_with_address_deletes_its_application_on_exit(default_model, other_cluster):
    process, url = serve_on_ray_command(default_model, "--address", other_cluster, env=CLUSTER_AUTH)
    try:
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        assert applications_on(other_cluster) == ["powerinfer"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
        assert applications_on(other_cluster) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
