"""The README's "As a Ray job" flow, as a user runs it: `ray start --head`, `ray job submit --
python examples/disagg_job.py`, the job SUCCEEDED with 100% exact match, the cluster stopped.

The head runs on free ports with its own temp dir, in the foreground (`ray start --block`) of a
process group of its own, and is stopped by signalling that process: `ray stop` would stop every
Ray process of the machine, other tests' and other users' clusters included. RAY_ADDRESS is
never set in this process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 8
#: Seconds the head may take to serve its dashboard, and a job to run to its end.
START_DEADLINE_S = 120
JOB_DEADLINE_S = 420


def _ray_cli() -> list[str]:
    """The `ray` command of this interpreter's Ray (its venv's script, else the module)."""
    script = Path(sys.executable).with_name("ray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _free_ports(count: int) -> list[int]:
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # The job's `python` is this interpreter (CI runs in an activated venv; a bare pytest may not).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # With token authentication on, `ray job submit` is refused by a `ray start` cluster (README).
    env["RAY_AUTH_MODE"] = "disabled"
    # Stop at once on SIGTERM instead of draining the node for up to 30 s.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    return env


def _session_processes(session_id: int) -> list[int]:
    """Processes still in the session the head was started in (its descendants)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == session_id:
                    pids.append(int(entry))
    return pids


def _stop_head(head: subprocess.Popen[bytes]) -> None:
    """Stop the head and everything it started, and nothing else."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _session_processes(head.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _session_processes(head.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _ray_head(env: dict[str, str]) -> Iterator[str]:
    """A head node started with `ray start --head`; yields its dashboard (jobs API) address."""
    temp_dir = tempfile.mkdtemp(prefix="kvray-job-")  # short: Ray's socket paths live under it
    gcs, dashboard, client, agent = _free_ports(4)
    command = [
        *_ray_cli(),
        "start",
        "--head",
        "--block",
        f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--num-cpus=4",
        "--disable-usage-stats",
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited with {head.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/api/version", timeout=5):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the head's dashboard did not answer within {START_DEADLINE_S} s")
            time.sleep(0.5)
        yield url
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _ray(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_ray_cli(), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_demo_runs_as_a_ray_job() -> None:
    env = _environment()
    with _ray_head(env) as address:
        job_id = "kvray-demo-job"
        entrypoint = ["python", "examples/disagg_job.py", "--prompts", str(PROMPTS), "--max-new-tokens", "4"]
        deadline = time.monotonic() + JOB_DEADLINE_S
        while True:
            # Blocks until the job ends, streaming its logs.
            submitted = _ray(
                env,
                "job",
                "submit",
                f"--address={address}",
                f"--submission-id={job_id}",
                "--",
                *entrypoint,
                timeout=max(deadline - time.monotonic(), 1),
            )
            output = submitted.stdout + submitted.stderr
            # The head's dashboard answers before its node agent has registered: retry that.
            if "No available agent" not in output or time.monotonic() > deadline:
                break
            time.sleep(1)
        status = _ray(env, "job", "status", f"--address={address}", job_id, timeout=60)
        logs = _ray(env, "job", "logs", f"--address={address}", job_id, timeout=60)
    assert submitted.returncode == 0, output[-4000:]
    # `ray job status` prints this line for JobStatus.SUCCEEDED only.
    assert f"Job '{job_id}' succeeded" in status.stdout + status.stderr, status.stdout + status.stderr
    assert f"exact match, disaggregated vs colocated  100.0% ({PROMPTS}/{PROMPTS})" in logs.stdout, (
        logs.stdout
    )
    assert "RESULT: PASS" in logs.stdout
