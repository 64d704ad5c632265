"""Task accuracy: GSM8K (final-number exact match) and HumanEval pass@1 (code run in a subprocess).

HumanEval completions are untrusted model output: each program runs in a separate ``python -I``
process with a timeout, in a temporary directory, with sockets disabled before the program starts.
This keeps a stray program from hanging the run or reaching the network; it is not a security sandbox.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from ..datasets import GSM8K_INSTRUCTION, Problem, gsm8k, humaneval  # noqa: F401  (re-exported)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert", "\n```")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k_correct(output: str, gold: str) -> bool:
    """The final number of the output (after the last '####' if present, else the last number) equals the gold."""
    tail = output.split("####")[-1] if "####" in output else output
    numbers = NUMBER.findall(tail)
    if not numbers:
        return False
    got, want = _as_number(numbers[-1] if "####" not in output else numbers[0]), _as_number(gold)
    return got is not None and want is not None and abs(got - want) < 1e-6


def truncate_completion(completion: str) -> str:
    """Cut a code completion at the first point where the function body has clearly ended."""
    cut = len(completion)
    for stop in STOP_SEQUENCES:
        i = completion.find(stop)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


_NO_NETWORK = (
    "import socket\n"
    "def _blocked(*a, **k):\n    raise OSError('network disabled')\n"
    "socket.socket = _blocked\nsocket.create_connection = _blocked\n"
)


def humaneval_passes(completion: str, reference: dict, timeout: float = 10.0) -> bool:
    """Run prompt + completion + the task's tests in a subprocess; True iff it exits 0 within ``timeout``."""
    program = (_NO_NETWORK + reference["prompt"] + truncate_completion(completion) + "\n\n" + reference["test"]
               + f"\n\ncheck({reference['entry_point']})\n")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", program], cwd=tmp, capture_output=True,
                                  timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def score(problem: Problem, output: str) -> bool:
    if problem.task == "gsm8k":
        return gsm8k_correct(output, problem.reference["answer"])
    return humaneval_passes(output, problem.reference)
