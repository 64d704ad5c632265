"""Task scoring (GSM8K, HumanEval in a subprocess) and the Hugging Face peers on a tiny model."""

import pytest
from conftest import tiny_model

from verispec import Tree, generate, get_verifier
from verispec.bench.peers import hf_generate
from verispec.bench.tasks import gsm8k, gsm8k_correct, humaneval, humaneval_passes, score, truncate_completion
from verispec.drafters import NoDrafter


@pytest.mark.parametrize("output,gold,ok", [
    ("She makes 9 * 2 = 18 dollars.\n#### 18", "18", True),
    ("The answer is 1,234.", "1234", True),
    ("#### 18.0 dollars", "18", True),
    ("First 5, then 7. So the answer is 12", "12", True),
    ("#### 17\nbut maybe 18", "18", False),
    ("no number here", "3", False),
    ("The answer is -4.", "-4", True),
])
def test_gsm8k_final_number(output, gold, ok):
    assert gsm8k_correct(output, gold) is ok


def test_gsm8k_and_humaneval_load():
    g = gsm8k(3)
    assert len(g) == 3 and g[0].reference["answer"] == "18" and g[0].chat
    h = humaneval(2)
    assert h[0].id == "HumanEval/0" and not h[0].chat and "def has_close_elements" in h[0].prompt


def test_truncate_completion_at_the_end_of_the_function():
    body = "    return a + b\n\ndef other():\n    pass\n"
    assert truncate_completion(body) == "    return a + b\n"
    assert truncate_completion("    return 1\n\nprint(f())") == "    return 1\n"


def canonical(i):
    import gzip
    import json

    from verispec.datasets import DATA_DIR

    with gzip.open(DATA_DIR / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        for j, line in enumerate(f):
            if j == i:
                return json.loads(line)["canonical_solution"]


def test_humaneval_runs_the_tests_in_a_subprocess():
    problem = humaneval(1)[0]
    assert humaneval_passes(canonical(0), problem.reference)
    assert score(problem, canonical(0))
    assert not humaneval_passes("    return True\n", problem.reference)  # fails the tests
    assert not humaneval_passes("    while True:\n        pass\n", problem.reference, timeout=2)  # times out
    net = "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return True\n"
    assert not humaneval_passes(net, problem.reference)  # sockets are disabled


@pytest.fixture(scope="module")
def target():
    t = tiny_model("llama", seed=0, layers=4)
    t.hf.generation_config.eos_token_id = None
    t.eos_token_ids = frozenset()
    return t


PROMPT = [5, 17, 33, 8, 9, 41, 5, 17]


def test_hf_peers_greedy_equal_verispec_greedy(target):
    ours = generate(target, NoDrafter(), get_verifier("chain"), PROMPT, tree=Tree.root_only(), max_new_tokens=16,
                    temperature=0.0).token_ids
    plain = hf_generate(target, PROMPT, 16, 0.0)
    assert plain.token_ids == ours and plain.drafted == []
    assistant = tiny_model("llama", seed=1, layers=2)
    assistant.hf.generation_config.eos_token_id = None
    assisted = hf_generate(target, PROMPT, 16, 0.0, assistant=assistant, assistant_config={"num_assistant_tokens": 3})
    assert assisted.token_ids == ours
    assert assisted.drafted and all(0 <= a <= d for d, a in zip(assisted.drafted, assisted.accepted))


def test_hf_peer_sampling_is_seeded(target):
    a = hf_generate(target, PROMPT, 12, 0.8, seed=4)
    b = hf_generate(target, PROMPT, 12, 0.8, seed=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12 and a.wall_s > 0
