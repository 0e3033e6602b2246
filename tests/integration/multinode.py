"""Several real Ray nodes on one machine: a head and workers started with
``ray start``, each with its own node IP on the loopback range (127.0.0.1,
.2, .3), inside the tests' loopback-only network namespace.

A component that assumes one host (binds or advertises 127.0.0.1 where
another node must reach it) fails here as it would on real nodes: each
node's raylet, object manager and workers listen on that node's address.

    with RayNodes(num_workers=2) as nodes:
        env = nodes.client_env()          # for a driver that joins (prefixserve up --address)
        subprocess.Popen([...,"--address", nodes.address], env=env)

What differs from a local ``ray.init``:

- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is removed from every node's and
  client's environment: with it a joining worker refuses to start ("Multi-node
  Ray clusters are not supported").
- Token authentication is on (``RAY_AUTH_MODE=token``, as Ray 2.60's
  ``ray start`` does by default) with a token of this harness
  (``RAY_AUTH_TOKEN``), never the user's ``~/.ray/auth_token``.
- ``ray start`` daemonizes: this process becomes a child subreaper
  (``PR_SET_CHILD_SUBREAPER``), so every process a node starts stays in this
  process's tree and ``stop()`` ends exactly those, by PID (never ``ray
  stop``, which would end every Ray on the machine).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

PR_SET_CHILD_SUBREAPER = 36
HEAD_IP = "127.0.0.1"


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class RayNode:
    """One ``ray start``: its node IP and the processes it left running."""

    ip: str
    pids: list[int] = field(default_factory=list)
    start_seconds: float = 0.0

    def processes(self) -> list[psutil.Process]:
        """The node's processes and all their descendants (its workers, replicas)."""
        out = []
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                out += [root] + root.children(recursive=True)
            except psutil.Error:
                pass
        return out

    def kill(self) -> None:
        """SIGKILL every process of the node (a node lost whole)."""
        for proc in self.processes():
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


class RayNodes:
    """A head and ``num_workers`` worker nodes, each a real ``ray start``.

    Args:
        num_workers: Worker nodes (node IPs 127.0.0.2, .3, ...).
        num_cpus: Logical CPUs each node offers (fractional replicas fit).
        object_store_mb: Each node's object store.
        autoscaling_config: Ray's autoscaler on the head with this cluster
            config (``provider.type: fake_multinode``: the autoscaler starts the
            nodes it adds as processes of its own, under the head's tree, so
            ``stop()`` ends them too); its GCS address is filled in.
    """

    def __init__(self, num_workers: int = 2, num_cpus: int = 2, object_store_mb: int = 128,
                 autoscaling_config: Optional[dict] = None) -> None:
        self.autoscaling_config = autoscaling_config
        self.num_workers = num_workers
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.token = secrets.token_hex(16)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ps-nodes-", dir="/tmp"))
        self.port = _free_port(HEAD_IP)
        self.nodes: list[RayNode] = []

    @property
    def address(self) -> str:
        """The head's GCS address, what ``--address`` takes."""
        return f"{HEAD_IP}:{self.port}"

    def client_env(self) -> dict[str, str]:
        """The environment of a node or a driver that joins the cluster."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0")
        return env

    def start(self) -> "RayNodes":
        """Starts the head, then each worker, and waits until all are alive."""
        _become_subreaper()
        try:
            self._start_node(HEAD_IP, ["--head", "--port", str(self.port), "--include-dashboard=false",
                                       "--temp-dir", str(self.temp_dir), *self._autoscaler_args()],
                             self._autoscaler_env())
            # One at a time: two at once race for the session's socket names
            # (plasma_store.1, raylet.1) and one times out.
            for i in range(self.num_workers):
                self._start_node(f"127.0.0.{i + 2}", ["--address", self.address])
            self.wait_alive(1 + self.num_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def _autoscaler_args(self) -> list[str]:
        if self.autoscaling_config is None:
            return []
        config = json.loads(json.dumps(self.autoscaling_config))
        config["provider"]["gcs_address"] = self.address  # else the fake provider assumes port 6379
        path = self.temp_dir / "autoscaling.json"
        path.write_text(json.dumps(config))
        return [f"--autoscaling-config={path}"]

    def _autoscaler_env(self) -> dict[str, str]:
        # The fake provider refuses to run without RAY_FAKE_CLUSTER; one autoscaler round a second.
        return {} if self.autoscaling_config is None else {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}

    def _start_node(self, ip: str, args: list[str], extra_env: Optional[dict[str, str]] = None) -> None:
        """Runs ``ray start`` for one node and records the processes it left.

        Raises:
            RuntimeError: The start failed (with its output).
        """
        ray = str(Path(sys.executable).with_name("ray"))
        before = {p.pid for p in psutil.Process().children()}
        began = time.monotonic()
        proc = subprocess.run(
            [ray, "start", "--node-ip-address", ip, "--num-cpus", str(self.num_cpus),
             "--object-store-memory", str(self.object_store_mb * 1024**2), "--disable-usage-stats", *args],
            env={**self.client_env(), **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        # Daemonized, its processes were re-parented to this (subreaper) process;
        # each names its node's IP on its command line.
        pids = [p.pid for p in psutil.Process().children() if p.pid not in before and _node_ip_of(p) == ip]
        self.nodes.append(RayNode(ip, pids, time.monotonic() - began))
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on {ip} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")

    def restart(self, ip: str) -> RayNode:
        """Starts a worker node again with the node IP of one that was killed (the
        node's return); the killed ``RayNode`` stays listed, its processes gone."""
        self._start_node(ip, ["--address", self.address])
        return self.nodes[-1]

    def alive_node_ips(self) -> list[str]:
        """Node IPs Ray sees alive (asks ``ray list nodes`` is heavy; reads the GCS through a client)."""
        script = ("import ray, json; ray.init(address=%r, logging_level='ERROR');"
                  "print('ALIVE', json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
                  % self.address)
        out = subprocess.run([sys.executable, "-c", script], env=self.client_env(), capture_output=True,
                             text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        # Ray may print its own lines (a dead node's warning) around ours.
        line = next(line for line in out.stdout.splitlines() if line.startswith("ALIVE "))
        return json.loads(line[len("ALIVE "):])

    def wait_alive(self, count: int, timeout_s: float = 60.0) -> list[str]:
        """Node IPs once ``count`` nodes are alive."""
        deadline = time.monotonic() + timeout_s
        ips: list[str] = []
        while time.monotonic() < deadline:
            ips = self.alive_node_ips()
            if len(ips) >= count:
                return ips
            time.sleep(1.0)
        raise TimeoutError(f"only {ips} alive after {timeout_s:.0f}s, wanted {count} nodes")

    def stop(self) -> None:
        """SIGKILLs every process the nodes started (workers first, head last), by PID."""
        procs = [p for node in reversed(self.nodes) for p in node.processes()]
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        _reap({p.pid for p in procs})
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayNodes":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _node_ip_of(proc: psutil.Process) -> Optional[str]:
    """The node IP a Ray process was started for (``--node-ip-address=``, ``--node_ip_address=``)."""
    try:
        for arg in proc.cmdline():
            for flag in ("--node-ip-address=", "--node_ip_address=", "--monitor-ip=", "--host="):
                if arg.startswith(flag):
                    return arg[len(flag):]
    except psutil.Error:
        pass
    return None


def _reap(pids: set[int], timeout_s: float = 10.0) -> None:
    """Collects the exit status of each killed process once it is (or has been
    re-parented to become) this process's child, so none stays a zombie."""
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) our child: gone, or its parent reaps it
                done = pid if not psutil.pid_exists(pid) else 0
            if done:
                pids.discard(pid)
        time.sleep(0.1)


def node_of(pid: int, nodes: RayNodes) -> Optional[str]:
    """The node IP whose process tree holds ``pid`` (None: none does)."""
    for node in nodes.nodes:
        if any(p.pid == pid for p in node.processes()):
            return node.ip
    return None
