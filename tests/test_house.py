"""The house: the package's import structure, the README's example, streaming text, the Hugging Face door, and the
one-line errors a new user meets."""

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verispec"


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in the file). ``from pkg import sub`` depends on the
    submodule ``sub``, not on the package's face; ``from pkg import name`` on the module that defines it."""
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for a in node.names:
                    edges.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle(tmp_path):
    assert circles(import_graph()) == []
    # and the check can fail: two modules that import each other are a circle
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_no_library_module_imports_the_cli():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name not in ("cli.py", "__main__.py")
                 and any(m == "verispec.cli" or m.startswith("verispec.cli.") for m in _imports(p))]
    assert not offenders, offenders
    # and the check can fail: a module that does import it is caught
    assert "verispec.cli" in _imports(PACKAGE / "__main__.py")


def test_no_script_or_test_reaches_into_the_cli_for_library_work():
    """Scripts and tests take library pieces from the library (they may still run the CLI as a command)."""
    for p in [*ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/*.py")]:
        reached = {m for m in _imports(p) if m.startswith("verispec.cli.")}
        assert reached <= {"verispec.cli.main", "verispec.cli.build_parser"}, p


def test_every_algorithms_reference_in_the_code_resolves():
    """Docstrings point at docs/algorithms.md (the shared reference document is not in the repository)."""
    doc = (ROOT / "docs" / "algorithms.md").read_text()
    shared = "ALGORITHMS" + ".md"
    for p in [*PACKAGE.rglob("*.py"), *ROOT.glob("tests/*.py")]:
        text = p.read_text()
        assert shared not in text, p
        for quoted in re.findall(r'docs/algorithms\.md, "([^"]+)"', text):
            assert quoted in doc, (p, quoted)


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160
    first_screen = "\n".join(lines[:40])
    assert "verispec generate" in first_screen and "pytest" in first_screen
    for link in re.findall(r"\]\(([^)]+)\)", "\n".join(lines)):
        assert (ROOT / link).exists(), link


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"## In Python\n\n```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_imports_only_the_public_api():
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12
    tree = ast.parse(code)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"verispec"}
    import verispec

    for attr in re.findall(r"verispec\.(\w+)", code):
        assert attr in verispec.__all__, attr


@pytest.mark.slow
def test_readme_example_runs(capsys):
    exec(compile(readme_example(), "README.md", "exec"), {})  # noqa: S102 - our own README
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].strip() and float(out[-1].split()[0]) > 1.0  # the default draft had some token accepted


class Bytes:
    """A byte-level tokenizer: each id is one byte, decoded with replacement of incomplete characters."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streamed_text_never_shows_half_a_character():
    from verispec import TextStream

    text = "おはよう, mon ami. 早上好!"
    ids = list(text.encode())
    stream = TextStream(Bytes().decode)
    shown = "".join(stream.push([b]) for b in ids) + stream.flush()
    assert shown == text and "\ufffd" not in shown
    pieces = TextStream(Bytes().decode)
    assert pieces.push(ids[:1]) == "" and pieces.push(ids[1:3]) == "お"  # held back until its last byte


def test_hugging_face_door_matches_verispec_and_plain_generate():
    from verispec import Tree, build_drafter, generate, get_policy, get_verifier
    from verispec.integrations.transformers import speculative

    target = tiny_model("llama")
    ids = torch.tensor([[5, 17, 33, 8, 61, 42]])
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=20, pad_token_id=0, eos_token_id=2)
    plain = target.hf.generate(ids, do_sample=False, **kw)
    door = target.hf.generate(ids, custom_generate=speculative(draft="ngram", tree="chain:3"),
                              do_sample=False, **kw)
    assert door.tolist() == plain.tolist()  # greedy: exactly plain decoding
    # a fixed draft length on both sides: the auto policy's choices follow step costs timed on this machine, and
    # the door times its own wrapper of the model, so only a fixed policy makes the two runs comparable token by token
    out = target.hf.generate(ids, custom_generate=speculative(draft="ngram", tree="chain:3", seed=5,
                                                                          policy="fixed"),
                             do_sample=True, temperature=0.7, top_k=0, return_dict_in_generate=True, **kw)
    drafter = build_drafter("ngram", target)
    mine = generate(target, drafter, get_verifier("chain"), ids[0].tolist(), tree=Tree.chain(3), temperature=0.7,
                    max_new_tokens=20, seed=5, policy=get_policy("fixed"))
    assert out.sequences[0, 6:].tolist() == mine.token_ids  # same seed, same tokens
    assert len(out.steps) == len(mine.steps) and out.steps[0].accepted_length >= 1


def test_hugging_face_door_streams_and_refuses_what_it_cannot_do_exactly():
    from verispec import VerispecError
    from verispec.integrations.transformers import speculative

    target = tiny_model("llama")
    ids = torch.tensor([[5, 17, 33, 8, 61, 42]])

    class Collect:
        def __init__(self):
            self.parts = []

        def put(self, value):
            self.parts.append(value.tolist())

        def end(self):
            self.parts.append("end")

    streamer = Collect()
    out = target.hf.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=speculative(
        draft="ngram"), do_sample=False, max_new_tokens=10, pad_token_id=0, eos_token_id=2, streamer=streamer)
    streamed = [t for part in streamer.parts[1:-1] for t in part]
    assert streamer.parts[-1] == "end" and streamed == out[0, 6:].tolist()
    door = speculative(draft="ngram")
    for kw, message in ((dict(num_beams=2), "beam search"), (dict(do_sample=True, repetition_penalty=1.3), "top_p")):
        with pytest.raises(VerispecError, match=message):
            target.hf.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=door, max_new_tokens=4,
                               pad_token_id=0, **kw)
    with pytest.raises(VerispecError, match="a streamer shows one sequence"):
        target.hf.generate(torch.cat([ids, ids]), custom_generate=door, max_new_tokens=4, pad_token_id=0,
                           streamer=Collect())
    with pytest.raises(VerispecError, match="left-padded"):
        target.hf.generate(ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]]), custom_generate=door,
                           max_new_tokens=4, pad_token_id=0)


def test_hugging_face_door_takes_left_padded_batches():
    """A batch, left-padded as generate takes it, through the batched engine: each row as it decodes alone."""
    from verispec.integrations.transformers import speculative

    target = tiny_model("llama")
    rows = [[5, 17, 33, 8, 61, 42], [7, 8, 9], [44, 3, 90, 12]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    door = speculative(draft="ngram", tree="chain:3")
    kw = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=2, do_sample=False)
    batch = target.hf.generate(ids, attention_mask=mask, custom_generate=door, return_dict_in_generate=True, **kw)
    assert batch.sequences.shape[0] == 3 and torch.equal(batch.sequences[:, :width], ids) and len(batch.steps) == 3
    for i, r in enumerate(rows):
        alone = target.hf.generate(torch.tensor([r]), custom_generate=door, **kw)[0, len(r):].tolist()
        got = batch.sequences[i, width:].tolist()
        assert got[:len(alone)] == alone and all(t == 0 for t in got[len(alone):]), i
    plain = target.hf.generate(ids, attention_mask=mask, **kw)  # Hugging Face's own batched greedy decoding
    assert plain[:, width:].tolist() == batch.sequences[:, width:plain.shape[1]].tolist()


def cli(*args, timeout=120):
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    r.seconds = time.perf_counter() - t
    return r


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", "x", "--draft", "ngram:0"], "ngram:N with N >= 1"),
    (["generate", "--prompt", "x", "--draft", "eagle:README.md"], "a draft head is a .pt file"),
    (["generate", "--prompt", "x", "--temperature", "inf"], "finite"),
    (["generate", "--prompt", "x", "--tree", "chain:0"], "drafts nothing"),
    (["generate", "--prompt", "x", "--tree", "paths:;;"], "lists no paths"),
    (["generate", "--prompt", "x", "--tree", "50x50"], "at most 1024"),
    (["generate", "--prompt", "x", "--threads", "0"], "--threads"),
    (["bench", "--out", "README.md/x.jsonl", "--methods", "ar"], "is a file, not a folder"),
    (["plot", "README.md", "--out", "README.md"], "is a file"),
])
def test_bad_input_fails_fast_with_one_line(args, message):
    r = cli(*args)
    assert r.returncode == 2, r.stderr[-1500:]
    assert message in r.stderr and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert r.seconds < 30  # checked before any model loads


def test_a_broken_gguf_and_a_broken_head_give_one_line(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    r = cli("generate", "--prompt", "x", "--target", str(bad), "--draft", "none")
    assert r.returncode == 2 and "cannot load model" in r.stderr and "Traceback" not in r.stderr
    head = tmp_path / "head.pt"
    head.write_bytes(b"not a checkpoint")
    from verispec import VerispecError
    from verispec.eagle import EagleHead

    with pytest.raises(VerispecError, match="not a verispec draft head"):
        EagleHead.load(head, tiny_model("llama"))


def test_report_warns_on_a_cut_file_and_survives_a_closed_pipe(tmp_path):
    header = {"type": "header", "config": {"methods": ["ar"], "drafts": ["-"]}, "command": "x", "machine": {},
              "versions": {}, "git": "x"}
    c = {"T": 0.0, "seed": 0, "prompt": "a", "draft": "-", "method": "ar"}
    recs = [header, {"type": "step", "cell": c, "i": 0, "accepted_length": 1, "drafted": 0},
            {"type": "prompt", "cell": c, "category": "x", "tokens": 1, "wall_s": 1.0}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"type": "step", "ce')
    r = cli("report", str(path))
    assert r.returncode == 0 and "cut short" in r.stderr and "| 0 | - | ar |" in r.stdout
    cmd = f"{sys.executable} -m verispec report {path} {path} {path} | head -c 10"
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_one_default_temperature():
    import inspect

    from verispec import generate
    from verispec.cli import build_parser
    from verispec.probs import DEFAULT_TEMPERATURE

    assert inspect.signature(generate).parameters["temperature"].default == DEFAULT_TEMPERATURE
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.temperature == DEFAULT_TEMPERATURE


def test_every_command_option_has_help():
    from verispec.cli import build_parser

    parser = build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():  # each command's parser
        for opt in action._actions:
            if opt.option_strings and opt.dest != "help":
                assert opt.help and opt.help.strip(), (action.prog, opt.option_strings)


def test_the_cli_reference_is_generated_from_the_parser():
    r = subprocess.run([sys.executable, "scripts/make_cli_doc.py", "--check"], cwd=ROOT, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, "docs/cli.md is out of date: run python scripts/make_cli_doc.py"


def test_default_threads_follow_the_cores_and_omp_num_threads(monkeypatch):
    from verispec.backends import default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = default_threads()
    assert cores >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 5))
    assert default_threads() == cores  # never more threads than cores
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert default_threads() == cores


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "archive").glob("*.md"))]


def test_the_docs_name_no_file_that_is_not_there_and_design_md_is_a_map():
    """Every relative link and every repository path in backticks (``verispec/...``, ``tests/...``, ``scripts/...``,
    ``docs/...``, ``data/...``) in the README and docs/ names a file or folder that exists (docs/archive/ is history:
    its links are checked, not the files of its time); docs/design.md stays a map of at most 300 lines (figures live
    in results.md, studies in docs/archive/)."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"`((?:verispec|tests|scripts|docs|data)/[\w./-]+)`", text) * (doc.parent.name != "archive"):
            path = path.split("::")[0].rstrip(".")
            if "*" not in path and not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing
    assert len((ROOT / "docs" / "design.md").read_text().splitlines()) <= 300


def test_a_registered_draft_kind_reaches_the_cli_its_docs_and_the_benchmark_with_no_other_edit():
    """docs/design.md, "Where new things go": a drafter is its class and a builder registered with
    ``register_draft``; parsing, building, ``--draft``'s help (so docs/cli.md, rendered from the parser) and the
    benchmark's ``--drafts`` all read the registry."""
    import importlib.util

    from verispec import cli
    from verispec.drafters import DRAFTS, DraftSpec, NgramDrafter, build_drafter, register_draft

    @register_draft("echo", help="'echo' (this test's own draft)", takes_arg=False)
    def _echo(target, arg, **_):
        return NgramDrafter(target.vocab_size, max_n=2)

    try:
        assert DraftSpec.parse("echo") == DraftSpec("echo") and "echo" in DRAFTS
        assert isinstance(build_drafter("echo", tiny_model("llama")), NgramDrafter)
        spec = importlib.util.spec_from_file_location("make_cli_doc", ROOT / "scripts" / "make_cli_doc.py")
        doc = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(doc)
        rendered = doc.render()
        assert rendered.count("'echo' (this test's own draft)") >= 3  # generate, bench --drafts, tune-tree
        args = cli.build_parser().parse_args(["bench", "--drafts", "echo", "--methods", "ar"])
        assert [DraftSpec.parse(d) for d in args.drafts] == [DraftSpec("echo")]  # what cmd_bench checks
    finally:
        DRAFTS.pop("echo", None)


@pytest.mark.slow
def test_results_md_is_what_make_results_renders_from_the_committed_records(tmp_path):
    """docs/results.md is derived, never edited: ``python scripts/make_results.py --render`` writes exactly it from
    ``results/*.jsonl.gz`` (figures drawn into a folder of the test's own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_results", ROOT / "scripts" / "make_results.py")
    make_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_results)
    rendered = make_results.render(tmp_path / "figures") + "\n"
    assert rendered == (ROOT / "docs" / "results.md").read_text(), \
        "docs/results.md is not what make_results.py renders: run python scripts/make_results.py --render"
