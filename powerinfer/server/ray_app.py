"""`powerinfer serve --ray`: the server's app (`create_app`) as a Ray Serve deployment.

Each replica is a Ray actor process holding one loaded model and its continuous-batching scheduler;
Ray Serve's HTTP proxy and router spread requests over the replicas, restart a replica whose
process dies and, with autoscaling, add and remove replicas. Nothing here routes or balances:
Ray does. What is ours: the replica's health check reports model loading (so a replica takes
traffic only once loaded), every answer names its replica (x-powerinfer-replica, and a label on
/metrics), and the proxy answers in OpenAI's error shape for a replica that died mid-request
(powerinfer/server/ray_proxy.py).

Ray is imported inside the functions: the environment that configures a local Ray must be set
before the first import, and without the 'ray' extra the CLI must still give one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from powerinfer.errors import PowerInferError
from powerinfer.server.startup import app_options, check_model, listen

APP_NAME = "powerinfer"
DEPLOYMENT_NAME = "powerinfer"
PROXY_CALLBACK = "powerinfer.server.ray_proxy.proxy_middlewares"
PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# Ray's switch for a single-machine Ray (its default on macOS and Windows): Ray's processes bind to
# 127.0.0.1 instead of all interfaces (Serve's per-replica gRPC server excepted: docs/scale-out.md).
# Read when ray is first imported.
LOCAL_ONLY_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOADING_POLL_SECONDS = 0.1
HEALTH_CHECK_PERIOD_SECONDS = 5.0  # how soon a stalled replica is noticed (a dead one: at its next request)


def import_ray(address: str | None) -> Any:
    """`ray`, configured for a local single-machine instance when no cluster address is given."""
    if address is None:
        os.environ.setdefault(LOCAL_ONLY_VARIABLE, "0")
    try:
        import ray
        from ray import serve  # noqa: F401 - the 'serve' part of the extra
    except ImportError as error:
        raise PowerInferError(f"--ray needs the 'ray' extra (pip install 'powerinfer[ray]'): {error}") from None
    return ray


def connect(address: str | None) -> bool:
    """Joins the cluster at `address`, or starts a private local Ray (on 127.0.0.1, no dashboard)
    that never joins one already running here: Ray's own default would join the cluster named by
    RAY_ADDRESS or by the last `ray start` on this machine. Returns whether this call started or
    joined Ray (and so should disconnect or stop it)."""
    ray = import_ray(address)
    if ray.is_initialized():
        return False
    # The job's environment reaches the Serve controller and from it the HTTP proxies it starts:
    # that is how the proxy gets our error answers (a Serve already running keeps its own proxies).
    runtime_env = {"env_vars": {PROXY_CALLBACK_VARIABLE: PROXY_CALLBACK}}
    try:
        ray.init(address=address or "local", include_dashboard=False if address is None else None,
                 runtime_env=runtime_env, logging_level="WARNING", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise PowerInferError(f"cannot {'join the Ray cluster at ' + address if address else 'start Ray'}: {error}") from None
    return True


def deployment_options(args: argparse.Namespace) -> dict:
    """Ray Serve's deployment options from the flags: replicas or autoscaling, resources."""
    autoscaling = any(value is not None for value in (args.min_replicas, args.max_replicas, args.target_ongoing_requests))
    if autoscaling and args.replicas is not None:
        raise PowerInferError("--replicas fixes the count; autoscaling (--min-replicas, --max-replicas, "
                              "--target-ongoing-requests) is the other choice, not both")
    num_gpus = args.num_gpus or 0.0
    if (args.vram_budget or args.n_gpu_layers) and not num_gpus and args.accelerator != "cpu":
        flag = "--vram-budget" if args.vram_budget else "-ngl"
        raise PowerInferError(f"{flag} with --ray needs --num-gpus: each replica offloads to the GPU Ray gives it")
    target = args.target_ongoing_requests or args.parallel
    options: dict[str, Any] = dict(
        ray_actor_options={"num_cpus": cpus_per_replica(args), "num_gpus": num_gpus},
        # Up to one more request per slot waits inside a replica, so a slot that frees up is filled
        # between two decode steps; the rest wait in Ray's router, free to go to any replica.
        max_ongoing_requests=max(2 * args.parallel, math.ceil(target)),
        health_check_period_s=HEALTH_CHECK_PERIOD_SECONDS,
    )
    if autoscaling:
        low = 1 if args.min_replicas is None else args.min_replicas
        high = max(low, 1) if args.max_replicas is None else args.max_replicas
        if high < low:
            raise PowerInferError(f"--max-replicas {high} is below --min-replicas {low}")
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target}
    else:
        options["num_replicas"] = args.replicas or 1
    return options


def cpus_per_replica(args: argparse.Namespace) -> float:
    return 1.0 if args.num_cpus is None else args.num_cpus


def replica_deployment(llm_settings: dict, app_settings: dict):
    """The deployment: `create_app(**app_settings)` over `LLM(**llm_settings)`, one per replica,
    named after it."""
    from ray import serve

    from powerinfer.server.app import create_app

    def load():
        from powerinfer.llm import LLM

        return LLM(**llm_settings)

    def build_app():  # runs in the replica, after the class's constructor
        context = serve.get_replica_context()
        name = f"{context.deployment}#{context.replica_id.unique_id}"
        return create_app(load, replica=name, **app_settings)

    @serve.ingress(build_app)
    class PowerInferReplica:
        """One replica: the app's lifespan loads the model in a thread; Serve's health check waits
        for it (Serve's first check has no time limit and a replica takes requests once it passes)."""

        async def check_health(self) -> None:
            state = self.app.state.server
            while (health := state.health())[1] == "loading":
                await asyncio.sleep(LOADING_POLL_SECONDS)
            if health[0] != 200:
                raise RuntimeError(f"replica is not serving ({health[1]}): {state.load_error or 'see its /health'}")

    return serve.deployment(PowerInferReplica, name=DEPLOYMENT_NAME)


def prepare(args: argparse.Namespace, llm_settings: dict) -> tuple[dict, dict]:
    """What replicas need decided once, here: the model file (found by the caller, so a Hugging Face
    name is fetched once, not on every replica) checked and named by its absolute path, threads, and
    create_app's keywords (API keys read from their file here). Returns the replicas' LLM keywords
    and create_app's."""
    app = app_options(args)
    model = Path(llm_settings["model"])
    check_model(model, llm_settings["n_ctx"], args.parallel)
    # Replicas read the file at the same path: on a cluster, a shared or identical path on every node.
    replica = llm_settings | {"model": str(model.resolve()),
                              "threads": llm_settings["threads"] or max(1, int(cpus_per_replica(args)))}
    return replica, app


def deploy(args: argparse.Namespace, llm_settings: dict, options: dict) -> str:
    """Deploys the replicas (Serve's deployment `options`) of the model `llm_settings` name on the
    Ray this process is connected to and waits until they all serve; returns the base URL of Ray's
    HTTP proxy."""
    from ray import serve

    replica_settings, app = prepare(args, llm_settings)
    with listen(args.host, args.port) as probe:  # a taken port is one line here; 0 picks a free one for Ray's proxy
        port = probe.getsockname()[1]
    serve.start(http_options={"host": args.host, "port": port})
    try:
        serve.run(replica_deployment(replica_settings, app).options(**options).bind(), name=APP_NAME, route_prefix="/")
    except RuntimeError as error:
        raise PowerInferError(f"the replicas did not start: {str(error).strip().splitlines()[-1]}") from None
    return f"http://{args.host}:{port}"


def serve_on_ray(args: argparse.Namespace, llm_settings: dict) -> int:
    """`serve --ray`: deploy replicas of `LLM(**llm_settings)`, then serve until interrupted (Ctrl-C
    or SIGTERM); then remove the app, and stop Ray when it was started here."""
    options = deployment_options(args)  # bad flags are refused before Ray starts
    replicas = options.get("num_replicas") or "{min_replicas}..{max_replicas}".format(**options["autoscaling_config"])
    local = args.address is None
    started = connect(args.address)
    from ray import serve
    from ray.serve.exceptions import RayServeException

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # our own lines say where it listens

    print(f"powerinfer serve --ray: {replicas} replica(s) on {'a local Ray' if local else 'the Ray cluster'}; "
          f"loading the model ...", file=sys.stderr)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up as Ctrl-C does
    try:
        url = deploy(args, llm_settings, options)
        print(f"powerinfer serve --ray: listening on {url} ({args.parallel} slots per replica)", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        if not local:  # the cluster outlives us: take our application off it
            with contextlib.suppress(RayServeException):  # raised when Serve never started
                serve.delete(APP_NAME)
        if started:  # a private Ray: stops every process it started, the replicas too (a cluster: disconnects)
            import_ray(args.address).shutdown()
