"""kvrelay on a two-node Ray cluster (tests/cluster.py: two network namespaces joined by a veth link, one engine
replica per node, the ingress on the head): pulls cross the link over UCX's TCP transport and give the tokens a
recompute gives; the head's ingress plans with the remote replica's KV events; killing the worker node's replica
mid-conversation loses no turn.

The Ray drivers run inside the head's namespace (tests/two_nodes_driver.py); this process only starts them and
checks what they print. Where network namespaces cannot be made the tests fail and say why: CI's machines can make
them, and a skip would hide that these tests did not run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster import TwoNodeCluster, unavailable

HTTP_PORT = 8000


class Deployed:
    def __init__(self, cluster: TwoNodeCluster, info: dict) -> None:
        self.cluster = cluster
        self.info = info
        self.head_ip, self.worker_ip = cluster.ips["head"], cluster.ips["worker"]

    def run(self, command: str, *args: str) -> dict:
        return self.cluster.driver_json("-m", "tests.two_nodes_driver", "--address", self.cluster.address,
                                        "--worker-ip", self.worker_ip, command, *args)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Deployed]:
    if (why_not := unavailable()) is not None:
        pytest.fail(f"two Ray nodes need two network namespaces, which cannot be made here ({why_not}): run the "
                    "tests as root with iproute2 installed, as CI does")
    with TwoNodeCluster() as cluster:
        # Placement is not these tests' subject (their turns are forced, and the one planned turn may stay or pull):
        # the app starts without the start-up calibration.
        info = cluster.driver_json("-m", "tests.two_nodes_driver", "--address", cluster.address, "deploy",
                                   "--http", f"{cluster.ips['head']}:{HTTP_PORT}", "--no-calibration")
        yield Deployed(cluster, info)


def test_one_replica_per_node_each_reporting_its_node_and_the_ingress_on_the_head(two_nodes):
    replicas = two_nodes.info["replicas"]
    assert sorted(r["node_ip"] for r in replicas) == sorted([two_nodes.head_ip, two_nodes.worker_ip]), replicas
    assert len({r["node_id"] for r in replicas}) == 2
    assert two_nodes.info["ingress_node_ip"] == two_nodes.head_ip


def test_pulls_across_the_link_give_the_tokens_of_a_recompute(two_nodes):
    before = two_nodes.cluster.link_bytes()
    pulled = two_nodes.run("converse", "--mode", "pull", "--seed", "3")
    pulled_bytes = two_nodes.cluster.link_bytes() - before
    reference = two_nodes.run("converse", "--mode", "recompute", "--seed", "3")
    reference_bytes = two_nodes.cluster.link_bytes() - before - pulled_bytes
    worker_replica, head_replica = pulled["order"]
    for i, turn in enumerate(pulled["turns"][1:], start=1):
        assert turn["mode"] == "pull", turn
        # Every pull crosses nodes: the holder is the other node's replica.
        assert turn["holder"] == pulled["order"][(i - 1) % 2] != turn["replica"], turn
        # The engine counts the pulled tokens as cached: the whole history but the last turn's question.
        assert turn["cached_tokens"] >= turn["prompt_tokens"] - 40, turn
    assert [t["token_ids"] for t in pulled["turns"]] == [t["token_ids"] for t in reference["turns"]]
    assert worker_replica != head_replica
    # The KV really crossed the veth link: the first pull alone moves the first turn's whole history (nothing of it
    # is cached on the head), and the same conversation recomputed sends far less over the link.
    first_pull = pulled["turns"][1]["cached_tokens"] * pulled["kv_bytes_per_token"]
    assert pulled_bytes - reference_bytes >= first_pull, (pulled_bytes, reference_bytes, first_pull)


def test_the_head_ingress_plans_with_the_remote_replicas_kv_events(two_nodes):
    seen = two_nodes.run("remote_events", "--seed", "5")
    second = seen["second"]
    # The planner found the history in the worker replica's cache (only its KV events say so) and reused it there,
    # or pulled it from there: either way it came from what the remote replica reported.
    assert second["reused_tokens"] >= seen["history_tokens"] - 32, second
    assert second["replica"] == seen["remote"] or second["holder"] == seen["remote"], second
    assert seen["cached_tokens"] == second["reused_tokens"]


def test_killing_the_worker_nodes_replica_mid_conversation_loses_no_turn(two_nodes):
    out = two_nodes.run("kill_worker_mid_conversation", "--seed", "9")
    # The turn running on the worker when its replica died came back whole, continued on the head's replica.
    cut = out["interrupted"]
    assert "continued on another replica" in cut["kvrelay"]["reason"], cut["kvrelay"]
    assert cut["kvrelay"]["replica"] != out["killed"]
    assert len(cut["token_ids"]) == 1500 and cut["token_ids"] == cut["reference"]
    # The conversation goes on over HTTP.
    assert out["answers"] and all(a["status"] == 200 for a in out["answers"]), out["answers"]
    for answer in out["answers"]:
        assert answer["token_ids"] == answer["reference"], answer
        assert answer["kvrelay"]["replica"] != out["killed"]
