"""Two hosts without Docker (tests/netns.py): two network namespaces joined by a veth pair, one trainer-launch
node in each, talking gloo over that link only. Then the link is cut mid-training, and restored.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from fault_helpers import Launch, checkpoint_files, error_lines, wait_until
from helpers import checkpoint_steps, read_summary
from netns import COLLECTIVE_TIMEOUT_S, MASTER_ADDR, Host

from trainer.checkpoint import store as checkpoint

SLACK_S = 30  # start-up and teardown on a loaded 2-core runner; what is caught is the 30-minute default
RUN_BOUND_S = 240


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
    # The restart names the host cut off (its launcher's beats stopped reaching the store), not only the rank here
    # that timed out waiting for it; the rank's own line is a warning, since the job goes on.
    assert re.search(rf"^restart 1 of 10: host .+ \({hosts[1].address}\) went away \(its launcher stopped answering "
                     r"the rendezvous store for 3 s: .*\); rank \d \(host .+\) exited with code 1 when it lost its "
                     r"peers; the hosts still here meet again \(NNODES=1:2\)", output, re.M), output[-4000:]
    assert not error_lines(output), output[-4000:]
    summary = read_summary(shared / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 1 and summary["global_step"] == 75
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= committed, summary
    assert nodes[1].wait(RUN_BOUND_S) != 0, nodes[1].output()[-4000:]
    errors = error_lines(nodes[1].output())
    assert errors and f"the rendezvous host {MASTER_ADDR} went away" in errors[-1], nodes[1].output()[-3000:]
