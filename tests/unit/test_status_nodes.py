"""``prefixserve status`` shows the Ray node each replica runs on: the
replica sends its node IP with its directory heartbeat (text among the
numbers), ``ListReplicas`` carries it (``ReplicaInfo.node``), and the table
has a node column when the replicas run on several nodes or off loopback."""

from __future__ import annotations

from cluster.client.status import ReplicaRow, format_status
from router.server import _replica_info


def test_list_replicas_carries_the_node_and_status_shows_it_across_nodes():
    info = _replica_info("r1", {"num_running": 1, "node": "10.0.0.2"})
    assert (info.node, info.num_running) == ("10.0.0.2", 1)
    assert _replica_info("r0", {"num_running": 1}).node == ""  # an older replica: none reported
    rows = {"r1": ReplicaRow("r1", node="127.0.0.2", running=1), "r2": ReplicaRow("r2", node="127.0.0.3")}
    lines = format_status(rows, {}, show_metrics=False)
    assert lines[0].split()[:2] == ["replica", "node"]
    assert lines[1].split()[:2] == ["r1", "127.0.0.2"] and lines[2].split()[:2] == ["r2", "127.0.0.3"]


def test_no_node_column_on_one_loopback_node_but_one_for_a_remote_node():
    local = {rid: ReplicaRow(rid, node="127.0.0.1") for rid in ("r1", "r2")}
    assert "node" not in format_status(local, {}, show_metrics=False)[0]
    assert "node" not in format_status({"r1": ReplicaRow("r1")}, {}, show_metrics=False)[0]
    remote = format_status({"r1": ReplicaRow("r1", node="10.0.0.7")}, {}, show_metrics=False)
    assert "node" in remote[0] and "10.0.0.7" in remote[1]
