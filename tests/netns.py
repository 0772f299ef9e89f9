"""Two hosts without Docker: two network namespaces joined by a veth pair (tests/conftest.py's `hosts`
fixture), each a host with its own address and interface, reaching the other over that link only.

Needs root (CAP_NET_ADMIN) for `ip netns`; skipped with the reason otherwise (under CI=true, a failure).
Every address lives inside the two namespaces, which are deleted afterwards: nothing reaches the host's network.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fault_helpers import Launch, tiny_run
from helpers import skip_or_fail_in_ci

COLLECTIVE_TIMEOUT_S = 10
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

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    def launch(self, root: Path, samples: int, preflight: bool = False, elastic: bool = False) -> Launch:
        """This host's node of a tiny run; its files (node 0's checkpoints) stay under root, as on a real host.
        elastic: NNODES=1:2 and no NODE_RANK, the same settings on both hosts (root: one shared directory), recovery
        by a restart."""
        root.mkdir(exist_ok=True)
        args = tiny_run(root, samples) + ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S)]
        env = {"NNODES": "2", "NODE_RANK": str(self.node_rank), "NPROC_PER_NODE": "1",
               "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": "29500", "RDZV_TIMEOUT": "120",
               "GLOO_SOCKET_IFNAME": self.veth, "PREFLIGHT": "1" if preflight else "0",
               "TRAIN_NUM_WORKERS": "0"}  # the doctor sizes /dev/shm for DataLoader workers; in-memory data has none
        if elastic:  # the restart path's recovery (tests/test_inplace.py has the in-place one's)
            env.update(NNODES="1:2", RECOVERY="restart")
            del env["NODE_RANK"]
        return Launch(args, root, env, name=f"node{self.node_rank}", prefix=self.prefix)

    def link(self, state: str) -> None:
        result = ip("-n", self.netns, "link", "set", self.veth, state)
        assert result.returncode == 0, result.stderr

    def bytes_through_link(self) -> int:
        (info,) = json.loads(ip("-n", self.netns, "-s", "-j", "link", "show", "dev", self.veth).stdout)
        return info["stats64"]["rx"]["bytes"] + info["stats64"]["tx"]["bytes"]


def two_hosts() -> Iterator[list[Host]]:
    """The pair, host 0 at MASTER_ADDR; deleted when the generator closes."""
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
