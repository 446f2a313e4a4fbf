"""A Ray cluster started the way a user starts one, `ray start --head` (and `ray start
--address=...` for more nodes), each node a `ray start --block` child of the test.

Each node is stopped by signalling its own `ray start` process, which takes down the raylet,
GCS and workers it started: `ray stop` would stop every Ray process on the machine, other
people's clusters included."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from verst.fleet.launcher import free_port

NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([{"id": n["NodeID"], "resources": n["Resources"]}
                  for n in ray.nodes() if n["Alive"]]))
"""


@dataclass
class RayNodes:
    """The nodes of a cluster this test started, and its GCS address."""

    address: str = ""
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vray")))
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, nodes: list[tuple[int, dict[str, float]]], timeout_s: float = 120) -> None:
        """`nodes`: (CPUs, custom resources) of each node; the first is the head."""
        # a short root: Ray's unix sockets live under it, and their paths are limited to 107
        for index, (cpus, resources) in enumerate(nodes):
            if index == 0:
                port = free_port()
                where = ["--head", f"--port={port}", f"--temp-dir={self.temp_dir}"]
                where += ["--include-dashboard=false", "--disable-usage-stats"]
            else:
                where = [f"--address={self.address}"]
            cmd = [shutil.which("ray") or "ray", "start", *where, "--block"]
            cmd += [f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}"]
            cmd += [f"--object-store-memory={100 * 1024 * 1024}"]
            log = (self.temp_dir / f"node{index}.log").open("wb")
            # Ray turns token authentication on for a cluster started where a token file
            # (~/.ray/auth_token, written by any earlier local `ray.init`) exists, and then
            # refuses drivers that do not send it: this test cluster runs without
            env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
            self.processes.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            )
            if index == 0:
                self.address = self._head_address(port, timeout_s)
            self._wait_for(index + 1, timeout_s)

    def _head_address(self, port: int, timeout_s: float) -> str:
        """The GCS address the head wrote once it was up (its node's IP and `port`)."""
        deadline = time.monotonic() + timeout_s
        written = self.temp_dir / "ray_current_cluster"
        while not written.is_file() or not written.read_text().strip():
            self._check_alive()
            assert time.monotonic() < deadline, f"no Ray head after {timeout_s} s"
            time.sleep(0.2)
        address = written.read_text().strip()
        assert address.endswith(f":{port}"), address
        return address

    def _wait_for(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.nodes()) < count:
            self._check_alive()
            assert time.monotonic() < deadline, f"fewer than {count} Ray nodes after {timeout_s} s"
            time.sleep(0.5)

    def _check_alive(self) -> None:
        for index, process in enumerate(self.processes):
            if process.poll() is not None:
                log = (self.temp_dir / f"node{index}.log").read_text(errors="replace")
                raise AssertionError(f"`ray start` of node {index} exited:\n{log[-3000:]}")

    def nodes(self) -> list[dict]:
        """The live nodes as the cluster's GCS lists them: id and resources."""
        out = subprocess.run(
            [sys.executable, "-c", NODES_SCRIPT, self.address],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        """Workers first, then the head; each `ray start --block` stops what it started."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
