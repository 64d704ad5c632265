"""The benchmark harness: methods x drafts x data sets x temperatures x seeds, one JSONL record per step and
per prompt, resumable.

A results file holds, one JSON object per line:

* ``{"type": "header", ...}``: the resolved configuration, package versions, git revision, machine, command;
* ``{"type": "step", "cell": KEY, ...}``: one per decoding step (verispec methods, and Hugging Face assisted
  generation's verifications), with drafted nodes, accepted length, candidates tested and the time split;
* ``{"type": "prompt", "cell": KEY, ...}``: one per finished (method, draft, prompt, temperature, seed) cell,
  written after its steps: tokens, wall time, text;
* ``{"type": "audit", ...}``: the exhaustive exactness audit of the verifiers used (one per verifier).

A cell counts as done once its prompt record is in the file; resuming drops the step records of an
unfinished cell and runs it again. Every figure is derived from these records (``verispec.report``).
Each cell starts with a fresh draft-length policy and learning state, so cells are independent and a
resumed run gives the same records as an uninterrupted one (timings aside).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .datasets import Problem, load_prompts
from .errors import VerispecError
from .methods import Method, resolve_method
from .models import DEFAULT_TARGET

NO_DRAFT = "-"  # the draft field of methods that use none (plain decoding, Hugging Face generate)
HF_LOOKUP_TOKENS = 10  # Hugging Face prompt lookup's default number of proposed tokens


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    drafts: list[str] = field(default_factory=lambda: ["int8"])
    methods: list[str] = field(default_factory=lambda: ["hf-generate", "hf-assisted", "ar", "fixed"])
    datasets: list[str] = field(default_factory=lambda: ["spec-bench"])
    limit: int | None = 2  # prompts per Spec-Bench category / per other data set
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.6])
    seeds: list[int] = field(default_factory=lambda: [0])
    max_new_tokens: int = 64
    dtype: str = "float32"
    audit_cases: int = 0  # exhaustive audit cases per verifier used (0: no audit)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> list[Method]:
        if not self.methods:
            raise VerispecError("no methods given")
        if not self.drafts:
            raise VerispecError("no drafts given")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise VerispecError("temperatures must be given and >= 0")
        if self.max_new_tokens < 1:
            raise VerispecError("max_new_tokens must be >= 1")
        if not self.seeds:
            raise VerispecError("no seeds given")
        if self.audit_cases < 0:
            raise VerispecError("audit_cases must be >= 0")
        methods = [resolve_method(m) for m in self.methods]
        if len({m.name for m in methods}) != len(methods):
            raise VerispecError("a method is listed twice")
        return methods


# the --quick preset: every piece of the harness on the default model, under 10 minutes on 2 CPU cores
QUICK = BenchConfig(
    drafts=["int8"],
    methods=["hf-generate", "hf-assisted", "ar", "fixed", "specinfer@2x2", "resispec@2x2", "reserve@2x2"],
    datasets=["spec-bench"], limit=1, temperatures=[0.0, 0.6], seeds=[0], max_new_tokens=32, audit_cases=10,
)


@dataclass(frozen=True)
class Cell:
    temperature: float
    seed: int
    problem: Problem
    draft: str
    method: Method

    @property
    def key(self) -> dict:
        return {"T": self.temperature, "seed": self.seed, "prompt": self.problem.id, "draft": self.draft,
                "method": self.method.name}


def cell_id(key: dict) -> tuple:
    return key["T"], key["seed"], key["prompt"], key["draft"], key["method"]


def supports_assisted(draft: str) -> bool:
    """Hugging Face assisted generation takes a draft model (``int8``, ``model:...``) or prompt lookup (``ngram``)."""
    kind = draft.partition(":")[0]
    return kind in ("int8", "model", "ngram")


def plan(config: BenchConfig, methods: list[Method], problems: list[Problem]) -> tuple[list[Cell], list[str]]:
    """All cells, interleaved so that machine load hits the methods alike: per temperature, seed and prompt,
    every method (with every draft it uses) in turn. Returns (cells, notes about combinations left out)."""
    cells, notes = [], []
    for m in methods:
        for d in config.drafts:
            if m.peer == "assisted" and not supports_assisted(d):
                notes.append(f"{m.name} with draft {d}: Hugging Face assisted generation cannot use it; left out")
    for t in config.temperatures:
        for seed in config.seeds:
            for prob in problems:
                for m in methods:
                    if not m.uses_draft:
                        cells.append(Cell(t, seed, prob, NO_DRAFT, m))
                        continue
                    for d in config.drafts:
                        if m.peer == "assisted" and not supports_assisted(d):
                            continue
                        cells.append(Cell(t, seed, prob, d, m))
    return cells, notes


def git_revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    import torch  # noqa: PLC0415

    out = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu"}
    try:
        with open("/proc/meminfo") as f:
            out["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out


def header(config: BenchConfig, command: str | None = None) -> dict:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from . import __version__  # noqa: PLC0415

    return {
        "type": "header", "config": config.to_dict(),
        "versions": {"verispec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "git": git_revision(), "machine": machine(),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def finished_cells(records: list[dict]) -> set[tuple]:
    """Ids of the cells whose prompt record is written (their step records count; others' do not)."""
    return {cell_id(r["cell"]) for r in records if r.get("type") == "prompt"}


def read_records(path: str | Path) -> list[dict]:
    """All complete JSON lines of a results file (a line cut short by an interrupted write is dropped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the last line of an interrupted write
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def _resume_records(path: Path, config: BenchConfig) -> list[dict]:
    """The records to keep when resuming: the header, finished cells (steps and prompt) and audit rows."""
    records = read_records(path)
    if not records or records[0].get("type") != "header":
        raise VerispecError(f"{path} is not a verispec results file (no header line)")
    old = BenchConfig.from_dict(records[0]["config"]).to_dict()
    new = config.to_dict()
    diff = sorted(k for k in new if old.get(k) != new[k])
    if diff:
        raise VerispecError(f"cannot resume {path}: its configuration differs in {', '.join(diff)}; "
                            "use the same options, or another --out")
    done = finished_cells(records)
    return [r for r in records if r.get("type") in ("header", "audit")
            or (r.get("type") in ("step", "prompt") and cell_id(r["cell"]) in done)]


class Runner:
    """Runs cells on one target; drafters are built once per draft spec and reused."""

    def __init__(self, config: BenchConfig, target=None):
        from .models import CausalLM  # noqa: PLC0415

        self.config = config
        self.target = target if target is not None else CausalLM.load(config.target, dtype=config.dtype)
        self._drafters: dict[str, object] = {}
        self._prompt_ids: dict[str, list[int]] = {}

    def drafter(self, spec: str):
        from .cli import build_drafter  # noqa: PLC0415
        from .drafters import NoDrafter  # noqa: PLC0415

        if spec == NO_DRAFT:
            return NoDrafter()
        if spec not in self._drafters:
            self._drafters[spec] = build_drafter(spec, self.target, self.config.dtype)
        return self._drafters[spec]

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem.id not in self._prompt_ids:
            self._prompt_ids[problem.id] = self.target.encode_prompt(problem.prompt, chat=problem.chat)
        return self._prompt_ids[problem.id]

    def warm_up(self, cells: list[Cell]) -> None:
        """One short run of each (method kind, draft) pair first: first forwards allocate and are slow."""
        seen = set()
        for c in cells:
            kind = (c.method.peer, c.draft)
            if kind in seen:
                continue
            seen.add(kind)
            self.run(Cell(c.temperature, c.seed, c.problem, c.draft, c.method), max_new_tokens=4)

    def run(self, cell: Cell, max_new_tokens: int | None = None) -> tuple[list[dict], dict]:
        """Run one cell; returns (step records, prompt record)."""
        from .decode import generate  # noqa: PLC0415
        from .peers import hf_generate  # noqa: PLC0415
        from .tasks import score  # noqa: PLC0415

        target, m, ids = self.target, cell.method, self.prompt_ids(cell.problem)
        budget = max_new_tokens or self.config.max_new_tokens
        key = cell.key
        if m.peer is not None:
            kwargs = {}
            if m.peer == "assisted":
                drafter = self.drafter(cell.draft)
                if hasattr(drafter, "model"):
                    kwargs["assistant"] = drafter.model
                else:
                    kwargs["prompt_lookup"] = HF_LOOKUP_TOKENS
            res = hf_generate(target, ids, budget, cell.temperature, seed=cell.seed, **kwargs)
            steps = [{"type": "step", "cell": key, "i": i, "drafted": d, "accepted_length": a + 1}
                     for i, (d, a) in enumerate(zip(res.drafted, res.accepted))]
            out_ids, wall, prefill = res.token_ids, res.wall_s, None
        else:
            spec, policy, state = m.build()
            res = generate(target, self.drafter(cell.draft), spec, ids, tree=m.tree(), max_new_tokens=budget,
                           temperature=cell.temperature, policy=policy, verifier_state=state, seed=cell.seed)
            steps = [{"type": "step", "cell": key, "i": i, "drafted": s.drafted, "depth": s.draft_depth,
                      "accepted_length": s.accepted_length, "accepted_ranks": list(s.accepted_ranks),
                      "tested": list(s.tested), "emitted": len(s.emitted), "draft_s": s.draft_s,
                      "target_s": s.target_s, "verify_s": s.verify_s} for i, s in enumerate(res.steps)]
            out_ids, wall, prefill = res.token_ids, res.wall_s, res.prefill_s
        text = target.decode([t for t in out_ids if t not in target.eos_token_ids])
        correct = score(cell.problem, text) if cell.problem.task in ("gsm8k", "humaneval") else None
        prompt = {"type": "prompt", "cell": key, "dataset": cell.problem.task, "category": cell.problem.group,
                  "tree_nodes": m.tree().size - 1, "prompt_tokens": len(ids), "tokens": len(out_ids),
                  "wall_s": wall, "prefill_s": prefill, "steps": len(steps),
                  "stop": "eos" if out_ids and out_ids[-1] in target.eos_token_ids else "max_new_tokens",
                  "correct": correct, "token_ids": out_ids, "text": text}
        return steps, prompt


def run_bench(config: BenchConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False,
              target=None, progress: bool = True, warm_up: bool = True, log=print, command: str | None = None) -> Path:
    """Run (or resume) the benchmark described by ``config`` into the JSONL file ``out``; ``command`` is what the
    header records as the command that made it (default: this process's command line)."""
    from tqdm import tqdm  # noqa: PLC0415

    methods = config.validate()
    problems = [p for spec in config.datasets for p in load_prompts(spec, config.limit)]
    if not problems:
        raise VerispecError("no prompts selected")
    cells, notes = plan(config, methods, problems)
    for n in notes:
        log(f"note: {n}")
    out = Path(out)
    if out.exists() and not (resume or overwrite):
        raise VerispecError(f"{out} exists: pass --resume to continue it, or --overwrite to start again")
    kept = _resume_records(out, config) if out.exists() and resume else []
    done = finished_cells(kept)
    audited = {r["verifier"] for r in kept if r["type"] == "audit"}
    todo = [c for c in cells if cell_id(c.key) not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in kept or [header(config, command)]:
            f.write(json.dumps(r) + "\n")
    tmp.replace(out)
    if kept:
        log(f"resuming {out}: {len(done)} of {len(cells)} cells done")
    if todo:
        runner = Runner(config, target)
        if warm_up:
            runner.warm_up(todo)
        bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="bench", unit="cell",
                   disable=not progress, file=sys.stderr)
        rate: dict[str, list[float]] = {}
        with out.open("a", encoding="utf-8") as f:
            for cell in todo:
                steps, prompt = runner.run(cell)
                for r in steps:
                    f.write(json.dumps(r) + "\n")
                f.write(json.dumps(prompt) + "\n")
                f.flush()
                acc = rate.setdefault(cell.method.name, [0.0, 0.0])
                acc[0] += prompt["tokens"]
                acc[1] += prompt["wall_s"]
                bar.set_postfix_str(f"T={cell.temperature:g} {cell.method.name} {acc[0] / acc[1]:.1f} tok/s")
                bar.update(1)
        bar.close()
    verifiers = sorted({m.verifier for m in methods if m.verifier and m.shape != "none"} - audited)
    if config.audit_cases and verifiers:
        from .audit.run import audit  # noqa: PLC0415
        from .verifiers import get_verifier  # noqa: PLC0415

        with out.open("a", encoding="utf-8") as f:
            for name in tqdm(verifiers, desc="audit", disable=not progress, file=sys.stderr):
                (row,) = audit([get_verifier(name)], cases=config.audit_cases)
                f.write(json.dumps({"type": "audit", **row.as_dict(), "verifier": name}) + "\n")
                f.flush()
    return out
