"""A Ray driver on the head node of `tests/cluster.py`'s two-node cluster. Each command prints one JSON line.

    python -m tests.two_nodes_driver --address HEAD:6380 deploy --http HEAD:8000
    python -m tests.two_nodes_driver --address HEAD:6380 converse --mode pull|recompute --seed N
    python -m tests.two_nodes_driver --address HEAD:6380 remote_events
    python -m tests.two_nodes_driver --address HEAD:6380 kill_worker_mid_conversation --seed N

`deploy` runs kvrelay with one tiny-llama engine replica per node (Serve's `max_replicas_per_node`) and the ingress
pinned to the head node; the app outlives the driver (Serve's controller is detached), so later commands reach it
by name. The tests in tests/test_two_nodes.py assert on what these commands print.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

APP = "two_nodes"
MODEL = "tiny-llama"
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
TURNS = 4


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(40, 1000) for _ in range(n)]


def ingress() -> Any:
    from ray import serve

    return serve.get_app_handle(APP)


def replicas(timeout_s: float = 300) -> list[dict[str, Any]]:
    """The engine replicas the ingress sees, each with its node's IP, once two have reported."""
    import ray

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ingress().stats.remote().result()
        seen = [dict(r, node_ip=ip_of.get(r["node_id"], "?")) for r in stats["replicas"]]
        if len(seen) >= 2 or time.monotonic() > deadline:
            return sorted(seen, key=lambda r: r["replica_id"])
        time.sleep(0.5)


def on_node(node_ip: str) -> str:
    """The replica id of the engine replica on the node with this IP."""
    return next(r["replica_id"] for r in replicas() if r["node_ip"] == node_ip)


def deploy(head_ip: str, http: str, engine: dict[str, Any] | None, calibrate: bool) -> dict[str, Any]:
    """Serve the app (`engine`: its EngineConfig fields; default the tests' tiny-llama) and wait for its replicas and,
    with `calibrate`, the start-up calibration."""
    from ray import serve

    from app.builder import build_app
    from tests.conftest import TINY_ENGINE

    host, port = http.rsplit(":", 1)
    # One HTTP proxy, on the head: the worker's namespace has no such address to bind.
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": int(port)},
                logging_config={"log_level": "WARNING"})
    config = {
        "name": APP,
        "log_level": "WARNING",
        "calibrate": calibrate,
        "ingress_resources": {f"node:{head_ip}": 0.01},
        "pool": {"num_replicas": 2, "max_replicas_per_node": 1, "engine": engine or dict(TINY_ENGINE, model=MODEL)},
    }
    serve.run(build_app(config), name=APP, route_prefix="/")
    seen = replicas()
    ingress().calibrated.remote().result(timeout_s=300)  # at once without a calibration
    stats = ingress().stats.remote().result()
    return {"replicas": seen, "ingress_node_ip": stats["ingress"]["node_ip"]}


def converse(mode: str, seed: int, worker_ip: str, head_ip: str) -> dict[str, Any]:
    """A 4-turn conversation alternating nodes, starting on the worker's: every later turn pulls the history across
    the link from the other node (`pull`), or recomputes it (`recompute`, the reference)."""
    rng = random.Random(seed)
    order = [on_node(worker_ip), on_node(head_ip)]
    history = tokens(rng, 150)
    turns = []
    for turn in range(TURNS):
        target = order[turn % 2]
        force = ("recompute" if turn == 0 or mode == "recompute" else "pull", target)
        result = ingress().turn.remote(history, GREEDY, force).result(timeout_s=180)
        turns.append({"token_ids": result.token_ids, "mode": result.kvrelay.mode, "replica": result.kvrelay.replica,
                      "holder": result.kvrelay.holder, "cached_tokens": result.usage.cached_tokens,
                      "prompt_tokens": len(history)})
        history = history + result.token_ids + tokens(rng, 20)
    from kvtransfer.kv_shape import KVShape
    from model_prep.store import model_path
    from tests.conftest import TINY_ENGINE

    shape = KVShape.from_model_dir(model_path(MODEL), TINY_ENGINE["dtype"], 32)
    return {"order": order, "turns": turns, "kv_bytes_per_token": shape.kv_bytes(1)}


def remote_events(seed: int, worker_ip: str, head_ip: str) -> dict[str, Any]:
    """A turn computed on the worker node's replica, then the same history plus a question planned freely by the
    head node's ingress: what the planner sees of the remote replica's cache comes from that replica's KV events."""
    rng = random.Random(seed)
    remote = on_node(worker_ip)
    history = tokens(rng, 300)
    first = ingress().turn.remote(history, GREEDY, ("recompute", remote)).result(timeout_s=180)
    time.sleep(1.0)  # the replica's KV events reach the directory, the directory's changes the ingress's mirror
    follow = history + first.token_ids + tokens(rng, 20)
    second = ingress().turn.remote(follow, GREEDY).result(timeout_s=180)
    stats = ingress().stats.remote().result()
    return {"remote": remote, "second": second.kvrelay.model_dump(), "cached_tokens": second.usage.cached_tokens,
            "history_tokens": len(history), "directory": stats["directory"]}


def kill_worker_mid_conversation(seed: int, worker_ip: str, head_ip: str) -> dict[str, Any]:
    """A conversation whose history is held on the worker node: its replica (actor and engine processes) is
    SIGKILLed one second into a long turn running there. That turn must still come back whole (continued on the
    head's replica), and the next turns, over HTTP, must be answered; each as a recompute would answer it."""
    import httpx
    import psutil
    from ray import serve

    rng = random.Random(seed)
    remote = on_node(worker_ip)
    history = tokens(rng, 200)
    first = ingress().turn.remote(history, GREEDY, ("recompute", remote)).result(timeout_s=180)
    history = history + first.token_ids + tokens(rng, 20)
    engines = serve.get_deployment_handle("engines", app_name=APP)
    identity = next(i for i in (engines.identity.remote().result() for _ in range(60)) if i.replica_id == remote)
    long_turn = {**GREEDY, "max_tokens": 1500}
    pending = ingress().turn.remote(history, long_turn, ("local", remote))
    time.sleep(1.0)  # well into its 1500 tokens
    doomed = psutil.Process(identity.pid)
    procs = doomed.children(recursive=True) + [doomed]
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=30)
    cut = pending.result(timeout_s=300)
    cut_reference = ingress().turn.remote(history, long_turn, ("recompute", cut.kvrelay.replica)).result(
        timeout_s=300)
    interrupted = {"token_ids": cut.token_ids, "reference": cut_reference.token_ids,
                   "kvrelay": cut.kvrelay.model_dump()}
    history = history + cut.token_ids
    answers = []
    with httpx.Client(base_url=f"http://{head_ip}:{os.environ.get('KVRELAY_TWO_NODES_HTTP_PORT', '8000')}",
                      timeout=180) as http:
        for _ in range(TURNS - 2):
            history = history + tokens(rng, 20)
            resp = http.post("/v1/completions",
                             json={"model": MODEL, "prompt": history, "return_token_ids": True, **GREEDY})
            if resp.status_code != 200:
                answers.append({"status": resp.status_code, "body": resp.text[:500]})
                break
            body = resp.json()
            answer = ingress().turn.remote(history, GREEDY, ("recompute", body["kvrelay"]["replica"])).result(
                timeout_s=180)
            answers.append({"status": 200, "token_ids": body["choices"][0]["token_ids"],
                            "reference": answer.token_ids, "kvrelay": body["kvrelay"]})
            history = history + answer.token_ids
    return {"killed": remote, "pid": identity.pid, "interrupted": interrupted, "answers": answers}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--worker-ip")
    parser.add_argument("command", choices=["deploy", "converse", "remote_events", "kill_worker_mid_conversation"])
    parser.add_argument("--http", default="")
    parser.add_argument("--engine", type=json.loads, help="deploy: EngineConfig fields as JSON")
    parser.add_argument("--no-calibration", action="store_true", help="deploy: without the start-up calibration")
    parser.add_argument("--mode", default="pull")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    head_ip = args.address.rsplit(":", 1)[0]
    ray.init(address=args.address, namespace="serve", logging_level="ERROR", log_to_driver=False)
    if args.command == "deploy":
        out = deploy(head_ip, args.http, args.engine, not args.no_calibration)
    elif args.command == "converse":
        out = converse(args.mode, args.seed, args.worker_ip, head_ip)
    elif args.command == "remote_events":
        out = remote_events(args.seed, args.worker_ip, head_ip)
    else:
        out = kill_worker_mid_conversation(args.seed, args.worker_ip, head_ip)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
