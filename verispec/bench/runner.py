"""The benchmark harness: methods x drafts x data sets x temperatures x seeds in one process, interleaved prompt by
prompt, written as records (``verispec.bench.records``) and resumable.

Each cell starts with a fresh draft-length policy and learning state unless ``BenchConfig.carry_state`` keeps a
method's policy and verifier state across its prompts (online learning, as AdaSD's tables run); cells are then
independent and a resumed run gives the same records as an uninterrupted one (timings aside).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from ..audit.distortion import target_nll
from ..audit.run import audit
from ..backends import DEFAULT_TARGET, load, resolve_dtype
from ..datasets import Problem, load_prompts
from ..decode import generate
from ..drafters import NoDrafter, build_drafter
from ..errors import VerispecError
from ..methods import Plan, resolve
from ..verifiers import get_verifier
from ..verifiers.chain import chain_laws, position_law
from ..version import __version__
from .concurrency import verispec_loop
from .peers import PEERS, ConcurrentRun, Peer, PeerRun
from .records import (
    NO_DRAFT,
    LoadMeter,
    cell_id,
    finished_cells,
    git_revision,
    group_id,
    machine,
    read_records,
    step_record,
)
from .shadow import Shadow, check_shadows
from .tasks import score


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    drafts: list[str] = field(default_factory=lambda: ["auto"])
    methods: list[str] = field(default_factory=lambda: ["hf-generate", "hf-assisted", "ar", "default"])
    datasets: list[str] = field(default_factory=lambda: ["spec-bench"])
    limit: int | None = 3  # prompts per Spec-Bench category / per other data set
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.6])
    seeds: list[int] = field(default_factory=lambda: [0])
    max_new_tokens: int = 128
    dtype: str = "float32"  # resolved (backends.resolve_dtype) before a run: its records name what it computed in
    audit_cases: int = 0  # exhaustive audit cases per verifier used (0: no audit)
    carry_state: bool = False  # keep a method's policy and verifier state across its prompts (online learning)
    shadow: list[str] = field(default_factory=list)  # verifiers run beside the driver on the same steps
    shadow_seeds: int = 4  # coin seeds per shadow verifier and step
    distortion: bool = False  # record lossy rules' exact TV at every decoded position, and each cell's NLL
    backend: str = "hf"  # the target's engine: hf (transformers) or llama (llama.cpp on the GGUF file)
    concurrency: list[int] = field(default_factory=list)  # closed loops with N requests in flight (empty: none)
    rounds: int = 1  # closed loops: each (temperature, seed, N)'s methods this many times, in turn (see plan_groups)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> list[Plan | Peer]:
        if not self.methods:
            raise VerispecError("no methods given")
        if not self.drafts:
            raise VerispecError("no drafts given")
        if not self.temperatures or any(not 0 <= t < float("inf") for t in self.temperatures):
            raise VerispecError("temperatures must be given, finite and >= 0")
        if self.limit is not None and self.limit < 1:
            raise VerispecError("limit must be >= 1")
        if self.shadow_seeds < 1:
            raise VerispecError("shadow_seeds must be >= 1")
        for name in self.shadow:
            get_verifier(name)  # an unknown shadow is an error before any model loads
        if self.max_new_tokens < 1:
            raise VerispecError("max_new_tokens must be >= 1")
        if not self.seeds:
            raise VerispecError("no seeds given")
        if self.audit_cases < 0:
            raise VerispecError("audit_cases must be >= 0")
        if any(n < 1 for n in self.concurrency):
            raise VerispecError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rounds < 1:
            raise VerispecError(f"rounds must be >= 1, got {self.rounds}")
        if self.rounds > 1 and not self.concurrency:
            raise VerispecError("--rounds repeats closed loops; give --concurrency too")
        if self.concurrency and (self.shadow or self.distortion or self.carry_state):
            raise VerispecError("--concurrency runs closed loops of requests; --shadow, --distortion and --carry-state "
                                "are for one request at a time")
        methods = [PEERS[m] if m in PEERS else resolve(m) for m in self.methods]
        if len({m.name for m in methods}) != len(methods):
            raise VerispecError("a method is listed twice")
        return methods


BENCH_HELP = {
    "target": "target model: built-in alias, .gguf file, folder or hub id",
    "drafts": "drafts to run every drafting method with",
    "methods": "methods",
    "datasets": "prompt sets",
    "limit": "prompts per Spec-Bench category / per other set",
    "temperatures": "sampling temperatures (0: greedy)",
    "seeds": "random seeds",
    "max_new_tokens": "new tokens per prompt",
    "dtype": "what the target computes in: auto (bfloat16 where the CPU has bfloat16 arithmetic, else float32), "
             "float32, bfloat16 or float16",
    "audit_cases": "exhaustive exactness audit of the verifiers used, cases each (0: none)",
    "carry_state": "keep each method's draft-length policy and learning verifier state across its prompts (online "
                   "learning, as AdaSD's tables run); by default every cell starts fresh",
    "shadow": "verifiers to run beside each method's own on the very same steps (same draft, same target "
              "probabilities, no extra forwards): paired comparisons of acceptance",
    "shadow_seeds": "coin seeds per shadow verifier and step",
    "backend": "the target's engine: hf (Hugging Face transformers, in --dtype) or llama (llama.cpp on the GGUF file, "
               "a quantised target of its own; bash scripts/install_llama.sh)",
    "concurrency": "instead of one prompt at a time: for each N, every prompt as a request of a closed loop that "
                   "keeps N in flight (a new one starts as one finishes); records each request's latencies and each "
                   "loop's throughput",
    "rounds": "closed loops: run every temperature and N's methods this many times, in turn and in reverse order every "
              "other round, so that a slow spell of the machine falls on all of them; ratios are paired within a "
              "round and their intervals take in the spread between rounds; at T > 0 each round draws with its own "
              "seed (the seed + 1000 x the round), so the rounds sample texts too",
    "distortion": "record, for lossy rules, the exact total variation of their law from the target's at every "
                  "position a run tests, and for every cell at T > 0 the NLL of its text under the target",
}

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
    method: Plan | Peer  # a verispec method, or a peer (``bench.peers``)

    @property
    def key(self) -> dict:
        return {"T": self.temperature, "seed": self.seed, "prompt": self.problem.id, "draft": self.draft,
                "method": self.method.name}


def static_notes(config: BenchConfig) -> list[str]:
    """The cells a configuration leaves out by design, whatever the machine: a peer given a draft it cannot use."""
    return [f"{name} with draft {d} (it cannot use this draft)" for name in config.methods if name in PEERS
            and PEERS[name].drafts for d in config.drafts if not PEERS[name].takes_draft(d)]


def plan(config: BenchConfig, methods: list[Plan | Peer], problems: list[Problem]) -> tuple[list[Cell], list[str]]:
    """All cells, interleaved so that machine load hits the methods alike: per temperature, seed and prompt,
    every method (with every draft it uses) in turn, in reverse order for every other seed (each seed a round: a
    method's place in the turn, first after another prompt's last or last before the next, costs it alike in every
    ratio). Returns (cells, notes about the cells left out)."""
    cells, notes = [], []
    kept = []
    for m in methods:
        why = m.missing(config) if isinstance(m, Peer) else None
        if why:
            notes.append(f"the peer {m.name} ({why})")
            continue
        kept.append(m)
    notes += static_notes(config)
    for t in config.temperatures:
        for i, seed in enumerate(config.seeds):
            for prob in problems:
                for m in (kept if i % 2 == 0 else kept[::-1]):
                    if not m.drafts:
                        cells.append(Cell(t, seed, prob, NO_DRAFT, m))
                        continue
                    for d in config.drafts:
                        if isinstance(m, Peer) and not m.takes_draft(d):
                            continue
                        cells.append(Cell(t, seed, prob, d, m))
    return cells, notes


@dataclass(frozen=True)
class Group:
    """A closed loop: every prompt as a request, ``concurrency`` in flight (``bench.concurrency``)."""

    temperature: float
    seed: int
    draft: str
    method: Plan | Peer
    concurrency: int
    round: int = 0

    @property
    def key(self) -> dict:
        return {"T": self.temperature, "seed": self.seed, "draft": self.draft, "method": self.method.name,
                "concurrency": self.concurrency, "round": self.round}

    @property
    def draw_seed(self) -> int:
        """The seed its requests draw with: the configured seed in round 0, another one in each later round
        (``ROUND_SEED_STRIDE`` apart), the same for every method of a round. At T > 0 a round then samples texts of
        its own, so the rounds' spread takes in how much the texts drawn move a ratio, not only the machine's timing
        (with one seed for all rounds, two methods' different texts of a prompt were the same in every round); at
        T = 0 nothing changes."""
        return self.seed + ROUND_SEED_STRIDE * self.round


ROUND_SEED_STRIDE = 1000  # round r of a closed loop draws with seed + 1000 r (``Group.draw_seed``)


def plan_groups(config: BenchConfig, methods: list[Plan | Peer]) -> tuple[list[Group], list[str]]:
    """The closed loops of a ``--concurrency`` run, in the order they run: per temperature, seed and concurrency,
    ``config.rounds`` rounds of every method (with every draft it uses) in turn, the order reversed in every other
    round. One slot in the order is not as fast as another on a shared machine (two loops of the same method in one
    process differed by 20 % on this machine): alternating rounds spread that over all methods. Returns (groups,
    notes about what is left out)."""
    groups, notes, kept = [], [], []
    for m in methods:
        why = m.missing(config) if isinstance(m, Peer) else None
        if why is None and isinstance(m, Peer) and m.concurrent is None:
            why = "it cannot serve concurrent requests"
        if why:
            notes.append(f"the peer {m.name} ({why})")
            continue
        kept.append(m)
    notes += static_notes(config)
    for t in config.temperatures:
        for seed in config.seeds:
            for n in config.concurrency:
                loops = [(m, d) for m in kept for d in (config.drafts if m.drafts else [NO_DRAFT])
                         if not (isinstance(m, Peer) and m.drafts and not m.takes_draft(d))]
                for r in range(config.rounds):
                    groups += [Group(t, seed, d, m, n, r) for m, d in (loops if r % 2 == 0 else loops[::-1])]
    return groups, notes


def header(config: BenchConfig, command: str | None = None, notes: list[str] | None = None) -> dict:
    import transformers  # noqa: PLC0415 - a 0.7 s import, needed here only

    return {
        "type": "header", "config": config.to_dict(),
        "versions": {"verispec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "git": git_revision(), "machine": machine(),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "notes": list(notes or []),  # the cells left out, and why
    }


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
    return [r for r in records if r.get("type") in ("header", "audit", "cell")
            or (r.get("type") in ("step", "prompt") and cell_id(r["cell"]) in done)]


class Runner:
    """Runs cells on one target; drafters are built once per draft spec and reused."""

    def __init__(self, config: BenchConfig, target=None, log=print):
        self.config = config
        self.log = log
        self._notes: set[str] = set()
        self.target = target if target is not None else load(config.target, dtype=config.dtype,
                                                              backend=config.backend)
        self._drafters: dict[str, object] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._states: dict[tuple, tuple] = {}  # carried policy and verifier state per (method, draft, T, seed)

    def drafter(self, spec: str):
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
            kind = (c.method.name if isinstance(c.method, Peer) else None, c.draft)
            if kind in seen:
                continue
            seen.add(kind)
            self.run(Cell(c.temperature, c.seed, c.problem, c.draft, c.method), max_new_tokens=4, warm=True)

    def _build(self, cell: Cell, warm: bool):
        """The cell's ``Recipe``: fresh, or carried across the method's prompts (its policy and learning state)."""
        key = (cell.method.name, cell.draft, cell.temperature, cell.seed)
        drafter = self.drafter(cell.draft)
        if warm or not self.config.carry_state:
            return cell.method.build(self.target, drafter)
        if key not in self._states:
            self._states[key] = cell.method.build(self.target, drafter)
        return self._states[key]

    def run(self, cell: Cell, max_new_tokens: int | None = None, warm: bool = False) -> tuple[list[dict], dict]:
        """Run one cell; returns (step records, prompt record)."""
        target, m, ids = self.target, cell.method, self.prompt_ids(cell.problem)
        budget = max_new_tokens or self.config.max_new_tokens
        meter = LoadMeter()
        if isinstance(m, Peer):
            steps, out_ids, wall, prefill, tree_nodes = self._run_peer(cell, ids, budget)
        else:
            steps, out_ids, wall, prefill, tree_nodes = self._run_verispec(cell, ids, budget, warm)
        load = meter.stop()
        text = target.decode([t for t in out_ids if t not in target.eos_token_ids])
        correct = score(cell.problem, text) if cell.problem.task in ("gsm8k", "humaneval") else None
        prompt = {"type": "prompt", "cell": cell.key, "dataset": cell.problem.task, "category": cell.problem.group,
                  "tree_nodes": tree_nodes, "prompt_tokens": len(ids), "tokens": len(out_ids),
                  "wall_s": wall, "prefill_s": prefill, "steps": len(steps),
                  "stop": "eos" if out_ids and out_ids[-1] in target.eos_token_ids else "max_new_tokens",
                  "correct": correct, "token_ids": out_ids, "text": text, "load": load}
        if self.config.distortion and cell.temperature > 0 and (not isinstance(m, Peer) or m.scores_text) and out_ids:
            prompt["nll"] = target_nll(target, ids, out_ids, cell.temperature)
        return steps, prompt

    def run_group(self, group: Group, problems: list[Problem], max_new_tokens: int | None = None) -> list[dict]:
        """One closed loop: the records of its requests (steps, then a prompt record each) and of the loop."""
        budget = max_new_tokens or self.config.max_new_tokens
        ids = [self.prompt_ids(p) for p in problems]
        meter = LoadMeter()
        m, t = group.method, group.temperature
        if isinstance(m, Peer):
            requests = m.concurrent(ConcurrentRun(self.target, self.config.target, self.drafter(group.draft), problems,
                                                  ids, group.concurrency, t, group.draw_seed, budget,
                                                  torch.get_num_threads(), self.config.dtype))
            tree_nodes = 0
        else:
            drafter = self.drafter(group.draft)
            requests = verispec_loop(self.target, m, drafter, problems, ids, group.concurrency, t, group.draw_seed,
                                     budget)
            tree_nodes = m.tree_for(drafter).size - 1
        load = meter.stop()
        records = []
        for req, prompt_ids in zip(requests, ids):
            key = {**group.key, "prompt": req.problem.id}
            records += [step_record(key, i, s) for i, s in enumerate(req.steps)]
            text = self.target.decode([x for x in req.token_ids if x not in self.target.eos_token_ids])
            correct = score(req.problem, text) if req.problem.task in ("gsm8k", "humaneval") else None
            records.append({"type": "prompt", "cell": key, "dataset": req.problem.task, "category": req.problem.group,
                            "tree_nodes": tree_nodes, "prompt_tokens": len(prompt_ids), "tokens": len(req.token_ids),
                            "wall_s": req.latency_s, "latency_s": req.latency_s, "ttft_s": req.ttft_s,
                            "tpot_s": req.tpot_s, "submitted_s": req.submitted, "finished_s": req.finished,
                            "prefill_s": req.prefill_s, "steps": len(req.steps),
                            "stop": "eos" if req.token_ids and req.token_ids[-1] in self.target.eos_token_ids
                            else "max_new_tokens" if req.error is None else "error",
                            "error": req.error, "correct": correct, "token_ids": req.token_ids, "text": text,
                            "load": load, **({"token_source": req.token_source} if req.token_source else {})})
        tokens = sum(len(r.token_ids) for r in requests)
        wall = max(r.finished for r in requests) - min(r.submitted for r in requests)
        records.append({"type": "cell", "cell": group.key, "requests": len(requests), "tokens": tokens,
                        "wall_s": wall, "throughput": tokens / wall if wall > 0 else float("nan"),
                        "errors": sum(r.error is not None for r in requests), "load": load})
        return records

    def _run_peer(self, cell: Cell, ids: list[int], budget: int):
        res = cell.method.run(PeerRun(self.target, self.config.target, self.drafter(cell.draft), ids, budget,
                                      cell.temperature, cell.seed))
        steps = [{"type": "step", "cell": cell.key, "i": i, "drafted": d, "accepted_length": a + 1}
                 for i, (d, a) in enumerate(zip(res.drafted, res.accepted))]
        return steps, res.token_ids, res.wall_s, None, 0

    def _run_verispec(self, cell: Cell, ids: list[int], budget: int, warm: bool):
        run = self._build(cell, warm)
        spec, tree, children = run.verifier, run.tree, run.children
        drafter = self.drafter(cell.draft)
        shadow = tvs = None
        driver = spec
        if self.config.shadow and not warm and tree.size > 1:
            shadows, skipped = check_shadows(self.config.shadow, spec, children, tree.is_chain)
            for note in skipped:
                if note not in self._notes:
                    self._notes.add(note)
                    self.log(note)
            if shadows:
                shadow = Shadow(spec, shadows, self.config.shadow_seeds,
                                cell.seed * 7919 + zlib.crc32(cell.problem.id.encode()) % 100_003)
                driver = shadow.spec()
        if self.config.distortion and spec.position_rule is not None and not warm:
            driver, tvs = _recording(driver)
        res = generate(self.target, drafter, driver, ids, tree=tree, children=children, max_new_tokens=budget,
                       temperature=cell.temperature, policy=run.policy, verifier_state=run.verifier_state,
                       seed=cell.seed)
        # the verifier (and so each wrapper) ran on the steps that drafted something; a step with nothing drafted is
        # a draw from the target, which every shadow would have matched with accepted length 1 and no distortion
        verified = sum(1 for s in res.steps if s.drafted)
        shadows = iter(shadow.records if shadow is not None else [])
        distortions = iter(tvs if tvs is not None else [])
        if shadow is not None and len(shadow.records) != verified or tvs is not None and len(tvs) != verified:
            raise RuntimeError("a wrapped verifier was not called once per step with a draft")
        steps = []
        for i, s in enumerate(res.steps):
            extra = {}
            if shadow is not None:
                extra["shadow"] = next(shadows) if s.drafted else shadow.undrafted()
            if tvs is not None:
                extra["tv"] = next(distortions) if s.drafted else []
            steps.append(step_record(cell.key, i, s, **extra))
        return steps, res.token_ids, res.wall_s, res.prefill_s, tree.size - 1


def _recording(spec):
    """``spec`` recording, at each step, the exact total variation of its law from the target's at every position
    it tested (with its learning state as it is then): the distortion of the run itself. Returns (spec, tvs)."""
    tvs: list[list[float]] = []
    rule = spec.position_rule

    def fn(draft, p, rng, *state):
        verdict = spec.fn(draft, p, rng, *state)
        tested = len(verdict.tested)
        if tested:
            _, laws = chain_laws(draft)
            law = position_law(rule, p[:tested], laws[:tested], state[0] if state else None)
            tvs.append((0.5 * (law - p[:tested].double()).abs().sum(-1)).tolist())
        else:
            tvs.append([])
        return verdict

    return dataclasses.replace(spec, fn=fn), tvs


def run_bench(config: BenchConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False,
              target=None, progress: bool = True, warm_up: bool = True, log=print, command: str | None = None) -> Path:
    """Run (or resume) the benchmark described by ``config`` into the JSONL file ``out``; ``command`` is what the
    header records as the command that made it (default: this process's command line)."""
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype))  # the records name what it computed in
    methods = config.validate()
    problems = [p for spec in config.datasets for p in load_prompts(spec, config.limit)]
    if not problems:
        raise VerispecError("no prompts selected")
    if config.concurrency:
        return _run_groups(config, methods, problems, Path(out), resume, overwrite, target, progress, warm_up, log,
                           command)
    cells, notes = plan(config, methods, problems)
    for n in notes:
        log(f"note: left out: {n}")
    out = Path(out)
    kept = _start_records(out, config, resume, overwrite, command, notes)
    done = finished_cells(kept)
    audited = {r["verifier"] for r in kept if r["type"] == "audit"}
    todo = [c for c in cells if cell_id(c.key) not in done]
    if kept:
        log(f"resuming {out}: {len(done)} of {len(cells)} cells done")
    if todo:
        runner = Runner(config, target, log=log)
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
    verifiers = sorted({m.verifier.name for m in methods if isinstance(m, Plan) and m.drafts} - audited)
    if config.audit_cases and verifiers:
        with out.open("a", encoding="utf-8") as f:
            for name in tqdm(verifiers, desc="audit", disable=not progress, file=sys.stderr):
                (row,) = audit([get_verifier(name)], cases=config.audit_cases)
                f.write(json.dumps({"type": "audit", **row.as_dict(), "verifier": name}) + "\n")
                f.flush()
    return out


def _start_records(out: Path, config: BenchConfig, resume: bool, overwrite: bool, command: str | None,
                   notes: list[str]) -> list[dict]:
    """Start ``out`` for a run: refused where it exists unless resumed or overwritten; with ``resume``, the records
    of an earlier run of this configuration are kept (returned) and written back whole, else a new header."""
    if out.exists() and not (resume or overwrite):
        raise VerispecError(f"{out} exists: pass --resume to continue it, or --overwrite to start again")
    kept = _resume_records(out, config) if out.exists() and resume else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in kept or [header(config, command, notes)]:
            f.write(json.dumps(r) + "\n")
    tmp.replace(out)
    return kept


def _run_groups(config: BenchConfig, methods, problems, out: Path, resume: bool, overwrite: bool, target, progress: bool,
                warm_up: bool, log, command: str | None) -> Path:
    """``run_bench`` for ``--concurrency``: closed loops, each written whole once it ends (an interrupted one runs
    again on resume)."""
    groups, notes = plan_groups(config, methods)
    for n in notes:
        log(f"note: left out: {n}")
    kept = _start_records(out, config, resume, overwrite, command, notes)
    done = {group_id(r["cell"]) for r in kept if r.get("type") == "cell"}
    todo = [g for g in groups if group_id(g.key) not in done]
    if kept:
        log(f"resuming {out}: {len(done)} of {len(groups)} closed loops done")
    if not todo:
        return out
    runner = Runner(config, target, log=log)
    if warm_up:  # first forwards allocate and are slow: a short loop of each kind first, not recorded
        seen = set()
        for g in todo:
            kind = (g.method.name, g.draft)
            if kind not in seen:
                seen.add(kind)
                runner.run_group(Group(g.temperature, g.seed, g.draft, g.method, min(g.concurrency, 2)),
                                 problems[:2], max_new_tokens=4)
    bar = tqdm(total=len(groups), initial=len(groups) - len(todo), desc="closed loops", unit="loop",
               disable=not progress, file=sys.stderr)
    with out.open("a", encoding="utf-8") as f:
        for g in todo:
            where = f"T={g.temperature:g} N={g.concurrency} {g.method.name}" + \
                (f" round {g.round + 1}/{config.rounds}" if config.rounds > 1 else "")
            bar.set_postfix_str(where)
            records = runner.run_group(g, problems)
            for r in records:
                f.write(json.dumps(r) + "\n")
            f.flush()
            bar.set_postfix_str(f"{where} {records[-1]['throughput']:.1f} tok/s")
            bar.update(1)
    bar.close()
    return out
