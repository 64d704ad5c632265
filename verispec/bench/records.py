"""The one records format: what ``verispec bench`` writes and ``verispec report`` / ``verispec plot`` read.

A results file holds one JSON object per line:

* ``{"type": "header", ...}``: the resolved configuration, package versions, git revision, machine, command;
* ``{"type": "step", "cell": KEY, "i": I, ...}``: one per decoding step -- a ``StepRecord`` written field by field
  (``step_record``) and read back as one (``read_step``); Hugging Face assisted generation's verifications carry
  only ``drafted`` and ``accepted_length``. Shadow verifiers add a ``shadow`` field (see ``verispec.bench.shadow``);
* ``{"type": "prompt", "cell": KEY, ...}``: one per finished (method, draft, prompt, temperature, seed) cell,
  written after its steps: tokens, wall time, text, the machine's load while it ran;
* ``{"type": "cell", "cell": GROUP, ...}``: with ``--concurrency``, one per (temperature, seed, draft, method,
  concurrency, round): every prompt ran as a request of a closed loop keeping that many in flight; ``tokens``,
  ``wall_s`` (first request's start to last one's end), ``throughput`` (tokens per second) and ``requests``. Its
  requests' prompt records carry ``concurrency`` and ``round`` in their key and their latencies (``ttft_s``,
  ``tpot_s``, ``latency_s``). ``round`` counts from 0 (``--rounds``); records written before it lack it (round 0);
* ``{"type": "audit", ...}``: the exhaustive exactness audit of the verifiers used (one per verifier).

A cell counts as done once its prompt record is written; the steps of an unfinished cell never count. A concurrency
group counts as done once its cell record is written; the requests of an unfinished group never count.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..backends.cpu import cpu_name
from ..decode import StepRecord
from ..errors import VerispecError

NO_DRAFT = "-"  # the draft field of methods that use none (plain decoding, Hugging Face generate)
_STEP_FIELDS = {f.name for f in fields(StepRecord)}


def cell_id(key: dict) -> tuple:
    return key["T"], key["seed"], key["prompt"], key["draft"], key["method"], key.get("concurrency"), key.get("round", 0)


def group_id(key: dict) -> tuple:
    """A concurrency group: the cells that ran together in one closed loop (``key`` a prompt's or the group's)."""
    return key["T"], key["seed"], key["draft"], key["method"], key.get("concurrency"), key.get("round", 0)


def step_record(cell: dict, i: int, step: StepRecord, **extra) -> dict:
    """A step record: the ``StepRecord``'s fields as they are (tuples as lists), with its cell and index."""
    return {"type": "step", "cell": cell, "i": i, **asdict(step), **extra}


def read_step(record: dict) -> StepRecord:
    """The ``StepRecord`` a step record was written from."""
    d = {k: v for k, v in record.items() if k in _STEP_FIELDS}
    for k in ("accepted_ranks", "tested", "emitted"):
        if k in d:
            d[k] = tuple(d[k])
    return StepRecord(**d)


def finished_cells(records: list[dict]) -> set[tuple]:
    """Ids of the cells whose prompt record is written (their step records count; others' do not), leaving out the
    requests of a concurrency group whose cell record is not (an interrupted closed loop is run again whole)."""
    groups = {group_id(r["cell"]) for r in records if r.get("type") == "cell"}
    return {cell_id(r["cell"]) for r in records if r.get("type") == "prompt"
            and (r["cell"].get("concurrency") is None or group_id(r["cell"]) in groups)}


def read_records(path: str | Path, warn=None) -> list[dict]:
    """All complete JSON lines of a results file (``NAME.jsonl`` as a run writes it, or gzipped, ``NAME.jsonl.gz``,
    as the repository keeps it). A last line cut short by an interrupted write is dropped, and ``warn(message)`` (if
    given) is told; a broken line elsewhere is an error."""
    out = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.readlines()
    for n, line in enumerate(lines, start=1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                if warn is not None:
                    warn(f"{path}: the last line is cut short (an interrupted run?); it is left out")
                break
            raise VerispecError(f"{path}: line {n} is not a JSON record") from None
        if not line.endswith("\n") and warn is not None:
            warn(f"{path}: the last line has no newline (an interrupted run?)")
    return out


def git_revision() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    """What a run's speeds depend on: the CPU, its threads and memory, and (where the extra is installed) how
    llama.cpp was built -- its version, the instruction sets it was compiled for, and the options
    ``scripts/install_llama.sh`` recorded."""
    out = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu"}
    try:
        with open("/proc/meminfo") as f:
            out["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    llama = llama_build()
    if llama:
        out["llama_cpp"] = llama
    return out


def llama_build() -> dict | None:
    """llama-cpp-python's version, llama.cpp's system info (the instruction sets compiled in) and the build options
    the install script recorded; None without the extra. Read without loading the library into this process."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    code = "import llama_cpp; print(llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = run.stdout.strip().splitlines()
    out = {"version": lines[0] if lines else "?", "system_info": " ".join(lines[1:]).strip()}
    stamp = Path(sys.prefix) / "verispec-llama-build.json"
    try:
        out["cmake_args"] = json.loads(stamp.read_text())["cmake_args"]
    except (OSError, ValueError, KeyError):
        out["cmake_args"] = None  # not installed by scripts/install_llama.sh
    return out


def _repair_traversal(step: dict) -> dict:
    """Records written before commit d2ca1e0 carry a phantom first ``tested`` entry for the ``traversal`` verifier on
    steps that accepted no drafted token: ``[k + 1, k]`` where ``[k]`` is right (k candidates at depth 1, all
    rejected). A step that accepts nothing reaches one depth, so two entries are impossible; the right list is the
    last entry. Repaired on reading (the file stays as written), for the step's own verdict and for its shadows."""
    def fix(run: dict, verifier: str) -> None:
        if verifier == "traversal" and not run.get("accepted_ranks") and len(run.get("tested") or []) == 2:
            run["tested"] = run["tested"][1:]

    fix(step, step.get("cell", {}).get("method", "").partition("@")[0])
    for name, runs in (step.get("shadow") or {}).items():
        for run in runs:
            fix(run, name)
    return step


@dataclass
class Results:
    """A results file, read: its header, finished cells' prompt and step records, and audit rows."""

    header: dict
    prompts: list[dict]
    steps: dict[tuple, list[dict]]  # cell id -> its step records
    audits: list[dict]
    source: str = ""
    cells: list[dict] = field(default_factory=list)  # concurrency groups (their requests are in ``prompts``)

    @classmethod
    def load(cls, path: str | Path, warn=None) -> "Results":
        path = Path(path)
        if not path.is_file():
            raise VerispecError(f"results file not found: {path}")
        try:
            records = read_records(path, warn)
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError):
            raise VerispecError(f"{path} is not a verispec results file (not text, or not whole gzip)") from None
        if not records or not isinstance(records[0], dict) or records[0].get("type") != "header":
            raise VerispecError(f"{path} is not a verispec results file (no header line)")
        res = cls.from_records(records)
        res.source = str(path)
        return res

    @classmethod
    def from_records(cls, records: list[dict]) -> "Results":
        done = finished_cells(records)
        prompts = [r for r in records if r.get("type") == "prompt" and cell_id(r["cell"]) in done]
        steps = defaultdict(list)
        for r in records:
            if r.get("type") == "step" and cell_id(r["cell"]) in done:  # steps of unfinished cells do not count
                steps[cell_id(r["cell"])].append(_repair_traversal(r))
        return cls(records[0], prompts, dict(steps), [r for r in records if r.get("type") == "audit"],
                   cells=[r for r in records if r.get("type") == "cell"])

    def describe(self) -> str:
        """One line: the command and the machine the results came from."""
        m = self.header.get("machine", {})
        v = self.header.get("versions", {})
        cpu = f" ({m['cpu']})" if m.get("cpu") else ""
        return (f"`{self.header.get('command', '?')}` -- {m.get('processor', '?')}{cpu}, {m.get('cpu_count', '?')} "
                f"cores, {m.get('device', 'cpu')}, torch {v.get('torch', '?')}, transformers "
                f"{v.get('transformers', '?')}, git {self.header.get('git', '?')}, {self.header.get('started', '?')}")

    def llama_build(self) -> str:
        """How the run's llama.cpp was built, in one sentence (older runs did not record it)."""
        b = self.header.get("machine", {}).get("llama_cpp")
        if not b:
            return ("llama.cpp build: not recorded (runs before scripts/install_llama.sh: llama-cpp-python built by "
                    "pip with its default `-march=native` on that session's CPU).")
        args = f"`CMAKE_ARGS={b['cmake_args']}`" if b.get("cmake_args") else "options not recorded (not installed by " \
            "scripts/install_llama.sh)"
        return f"llama.cpp build: llama-cpp-python {b.get('version', '?')}, {args}; system info `{b.get('system_info')}`."


CONTENDED = 0.25  # cores' worth of other work during a cell above which the report leaves the cell out


class LoadMeter:
    """How much of the machine other processes used while a cell ran: (busy CPU time of the whole machine minus
    this process's own and its finished children's, such as a server a peer started and stopped) over the cell's
    wall time, in cores. A concurrent job can slow a torch run many times over when threads outnumber cores, so
    cells measured beside one are marked (``others_cores > CONTENDED``)."""

    def __init__(self):
        self._start = self._read()

    @staticmethod
    def _read():
        t = os.times()
        try:
            with open("/proc/stat") as f:
                parts = [int(v) for v in f.readline().split()[1:]]
            busy = (sum(parts[:3]) + sum(parts[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal
        except (OSError, ValueError):
            busy = None
        return time.perf_counter(), t.user + t.system + t.children_user + t.children_system, busy

    def stop(self) -> dict:
        wall0, own0, busy0 = self._start
        wall1, own1, busy1 = self._read()
        wall = max(wall1 - wall0, 1e-9)
        out = {"own_cores": round((own1 - own0) / wall, 3)}
        if busy0 is not None and busy1 is not None:
            out["others_cores"] = round(max(0.0, (busy1 - busy0) - (own1 - own0)) / wall, 3)
        return out


def contended(prompt: dict) -> bool:
    """Whether a prompt record's cell ran while other work competed for the cores."""
    return prompt.get("load", {}).get("others_cores", 0.0) > CONTENDED
