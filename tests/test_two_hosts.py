"""Two hosts without Docker: two network namespaces joined by a veth pair, one trainer-launch node in
each, talking gloo over that link only. Then the link is cut mid-training, and restored.

Needs root (CAP_NET_ADMIN) for `ip netns`; skipped with the reason otherwise (under CI=true, a failure).
Every address lives inside the two namespaces, which are deleted afterwards: nothing reaches the host's network.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_helpers import Launch, checkpoint_files, error_lines, tiny_run, wait_until
from helpers import checkpoint_steps, read_summary, skip_or_fail_in_ci

from trainer.checkpoint import store as checkpoint

COLLECTIVE_TIMEOUT_S = 10
SLACK_S = 30  # start-up and teardown on a loaded 2-core runner; what is caught is the 30-minute default
RUN_BOUND_S = 240
MASTER_ADDR = "10.200.0.1"
_names = itertools.count()


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    netns: str
    veth: str
    address: str
    node_rank: int

    def launch(self, root: Path, samples: int, preflight: bool = False, elastic: bool = False) -> Launch:
        """This host's node of the run; its files (node 0's checkpoints) stay under root, as on a real host.
        elastic: NNODES=1:2 and no NODE_RANK, the same settings on both hosts (root: one shared directory)."""
        root.mkdir(exist_ok=True)
        args = tiny_run(root, samples) + ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S)]
        env = {"NNODES": "2", "NODE_RANK": str(self.node_rank), "NPROC_PER_NODE": "1",
               "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": "29500", "RDZV_TIMEOUT": "120",
               "GLOO_SOCKET_IFNAME": self.veth, "PREFLIGHT": "1" if preflight else "0",
               "TRAIN_NUM_WORKERS": "0"}  # the doctor sizes /dev/shm for DataLoader workers; in-memory data has none
        if elastic:
            env["NNODES"] = "1:2"
            del env["NODE_RANK"]
        return Launch(args, root, env, name=f"node{self.node_rank}", prefix=["ip", "netns", "exec", self.netns])

    def link(self, state: str) -> None:
        result = ip("-n", self.netns, "link", "set", self.veth, state)
        assert result.returncode == 0, result.stderr

    def bytes_through_link(self) -> int:
        (info,) = json.loads(ip("-n", self.netns, "-s", "-j", "link", "show", "dev", self.veth).stdout)
        return info["stats64"]["rx"]["bytes"] + info["stats64"]["tx"]["bytes"]


@pytest.fixture
def hosts():
    tag = f"{os.getpid() % 100000}{next(_names)}"
    pair = [Host(f"ddpt{tag}n{i}", f"ddpt{tag}v{i}", f"10.200.0.{i + 1}", i) for i in range(2)]
    made = []
    try:
        for host in pair:
            result = ip("netns", "add", host.netns)
            if result.returncode != 0:
                skip_or_fail_in_ci("cannot create a network namespace (needs root / CAP_NET_ADMIN): "
                                   f"{result.stderr.strip()}")
            made.append(host.netns)
        steps = [("link", "add", pair[0].veth, "netns", pair[0].netns, "type", "veth",
                  "peer", "name", pair[1].veth, "netns", pair[1].netns)]
        for host in pair:
            steps += [("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.veth),
                      ("-n", host.netns, "link", "set", host.veth, "up"),
                      ("-n", host.netns, "link", "set", "lo", "up")]
        for step in steps:
            result = ip(*step)
            assert result.returncode == 0, f"ip {' '.join(step)}: {result.stderr}"
        yield pair
    finally:
        for netns in made:  # the veth pair goes with its namespaces
            ip("netns", "del", netns)


def start_both(hosts: list[Host], tmp_path: Path, samples: int, launches: list[Launch]) -> list[Launch]:
    """Node 0 runs trainer-doctor first: in its namespace the veth is the routable interface."""
    nodes = [host.launch(tmp_path / f"node{host.node_rank}", samples, preflight=host.node_rank == 0)
             for host in hosts]
    launches += nodes
    return nodes


def test_two_namespaces_train_together_fail_fast_when_the_link_is_cut_and_resume(hosts, tmp_path, launches):
    nodes = start_both(hosts, tmp_path, 2400, launches)
    checkpoints = tmp_path / "node0" / "checkpoints"
    wait_until(lambda: checkpoint_files(checkpoints) or nodes[0].proc.poll() is not None, RUN_BOUND_S,
               "node 0's first checkpoint")
    assert all(node.proc.poll() is None for node in nodes), nodes[0].output()[-3000:]
    first = checkpoint.load(checkpoint_files(checkpoints)[0])
    assert first["samples_per_batch"] == 16 * 2  # one world of two ranks, one per namespace
    assert hosts[0].bytes_through_link() > 2 ** 20  # the gradients crossed the veth pair
    assert "error:" not in nodes[0].output()  # node 0's preflight passed in its namespace

    hosts[1].link("down")
    cut_at = time.monotonic()
    # Each side names the other as gone: node 0 the host whose launcher stopped answering, node 1 the
    # rendezvous host (node 0, whose store it can no longer reach).
    gone = ["error: training failed: node 1 (host ", f"error: training failed: the rendezvous host {hosts[0].address}"]
    for node, expected in zip(nodes, gone):
        assert node.wait(COLLECTIVE_TIMEOUT_S + SLACK_S) != 0
        output = node.output()
        assert "Traceback" not in output, output[-4000:]
        errors = error_lines(output)
        # The wait ran out: nothing closed the connection, the link just carries nothing any more.
        collective = [line for line in errors if line.startswith("error: collective: ")]
        assert len(collective) == 1, output[-3000:]
        assert re.match(rf"error: collective: (Timed out waiting {COLLECTIVE_TIMEOUT_S * 1000}ms for \w+ operation "
                        r"to complete|Application timeout caused pair closure)\b", collective[0]), collective[0]
        assert errors[-1].startswith(expected) and " went away (" in errors[-1], output[-3000:]
    assert time.monotonic() - cut_at < COLLECTIVE_TIMEOUT_S + SLACK_S
    committed = checkpoint_steps(checkpoints)[-1]
    assert not checkpoint_files(tmp_path / "node1" / "checkpoints")  # rank 0's host holds them all

    hosts[1].link("up")
    nodes = start_both(hosts, tmp_path, 2400, launches)
    for node in nodes:
        assert node.wait(RUN_BOUND_S) == 0, node.output()[-4000:]
    summary = read_summary(tmp_path / "node0" / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["resumed_from_step"] == committed and summary["global_step"] == 75  # 2400 / (16 x 2)


def test_an_elastic_job_goes_on_alone_when_the_link_to_the_other_host_is_cut(hosts, tmp_path, launches):
    """NNODES=1:2 across the two namespaces, one checkpoint directory both see (as hosts share a file system).
    The link to host 1 is cut: no connection closes, nothing answers. Host 0 (the rendezvous host) is not left
    hanging in its collective (torch's elastic agents re-rendezvous only on a worker failure, pytorch #111646):
    the collective times out, its agent restarts, the rendezvous drops the silent host, and host 0 trains to the
    end at world size 1 from the newest checkpoint. Host 1 cannot reach the rendezvous store: it exits non-zero
    naming the rendezvous host."""
    shared = tmp_path / "shared"
    nodes = []
    for host in hosts:
        nodes.append(host.launch(shared, 2400, elastic=True))
        launches.append(nodes[-1])
        time.sleep(1)  # host 0 first: its launcher hosts the c10d store at MASTER_ADDR
    checkpoints = shared / "checkpoints"
    wait_until(lambda: checkpoint_files(checkpoints) or nodes[0].proc.poll() is not None, RUN_BOUND_S,
               "the first checkpoint")
    assert all(node.proc.poll() is None for node in nodes), nodes[0].output()[-3000:]
    both = nodes[0].output() + nodes[1].output()  # global rank 0 logs, on whichever host the round made node 0
    assert "world size 2 " in both, both[-3000:]
    committed = checkpoint_steps(checkpoints)[-1]

    hosts[1].link("down")
    assert nodes[0].wait(RUN_BOUND_S) == 0, nodes[0].output()[-4000:]
    output = nodes[0].output()
    assert "Traceback" not in output, output[-4000:]
    assert re.search(r"^restart 1 of 10: rank 0 exited with code 1; the hosts still here meet again \(NNODES=1:2\)",
                     output, re.M), output[-4000:]
    summary = read_summary(shared / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 1 and summary["global_step"] == 75
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= committed, summary
    assert nodes[1].wait(RUN_BOUND_S) != 0, nodes[1].output()[-4000:]
    errors = error_lines(nodes[1].output())
    assert errors and f"the rendezvous host {MASTER_ADDR} went away" in errors[-1], nodes[1].output()[-3000:]
