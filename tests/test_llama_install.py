"""The llama extra's install and load-time check, without llama.cpp: instruction probes that can tell a refused
instruction from a working one, wheels kept per build option (never pip's version-keyed cache), and an engine
that dies in its check refused with one sentence instead of killing the command."""

import importlib.util
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import VerispecError
from verispec.backends import llama

ROOT = Path(__file__).resolve().parent.parent


def build_script():
    spec = importlib.util.spec_from_file_location("llama_build", ROOT / "scripts" / "llama_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the probes with")
def test_a_probe_tells_a_refused_instruction_from_one_that_runs(tmp_path):
    b = build_script()
    assert b.probe("OK", "", "return 0;", tmp_path) == (True, "runs")
    assert b.probe("TRAP", "", "__builtin_trap(); return 0;", tmp_path) == (False, "killed by SIGILL")
    assert b.probe("BAD", "", "this is not C", tmp_path) == (False, "the compiler cannot build it")


def test_build_options_name_every_instruction_set_and_key_their_wheel():
    b = build_script()
    on = {k: (k in ("AVX", "AVX2"), "") for k in b.ALL_OPTIONS}
    args = b.cmake_args(on)
    assert args.startswith("-DGGML_NATIVE=OFF") and "-DGGML_AVX2=ON" in args and "-DGGML_AMX_INT8=OFF" in args
    assert args.count("-DGGML_") == len(b.ALL_OPTIONS) + 1
    other = b.cmake_args({**on, "AVX2": (False, "")})
    assert b.wheel_dir("0.3.36", args) != b.wheel_dir("0.3.36", other)  # other options, another wheel
    assert b.wheel_dir("0.3.36", args) == b.wheel_dir("0.3.36", args)


def test_features_the_cpu_does_not_advertise_stay_off(monkeypatch):
    b = build_script()
    monkeypatch.setattr(b, "cpu_flags", lambda: {"avx", "sse4_2"})
    monkeypatch.setattr(b, "probe", lambda *a: (True, "runs"))
    got = b.usable_features(without={"SSE42"})
    assert got["AVX"] == (True, "runs") and got["AVX2"] == (False, "not advertised by the CPU")
    assert got["SSE42"] == (False, "turned off (--without)") and not got["AMX_INT8"][0]


@pytest.fixture
def probe_as(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(llama, "_engine_key", lambda path: "k")

    def use(code: str):
        monkeypatch.setattr(llama, "_PROBE", code)

    return use


def test_an_engine_that_dies_is_refused_with_one_sentence(probe_as):
    probe_as("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(VerispecError) as err:
        llama.check_engine("model.gguf")
    message = str(err.value)
    assert "illegal instruction (SIGILL)" in message and "install_llama.sh" in message and "\n" not in message
    probe_as("import sys; sys.exit(4)")
    with pytest.raises(VerispecError, match="failed a short batch decode"):
        llama.check_engine("model.gguf")


def test_the_verdict_is_kept_once_the_engine_passed(probe_as):
    probe_as("pass")
    llama.check_engine("model.gguf")
    probe_as("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    llama.check_engine("model.gguf")  # the same library, CPU and model: not run again
    with pytest.raises(VerispecError, match="SIGSEGV"):
        llama.check_engine("model.gguf", use_cache=False)


def test_a_crash_in_the_check_never_reaches_the_caller(probe_as):
    """The probe runs in a child process: the caller survives a signal that would kill it."""
    probe_as("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    code = ("import sys; from verispec.backends import llama; llama._engine_key = lambda p: 'k'; "
            f"llama._PROBE = {llama._PROBE!r}\ntry:\n    llama.check_engine('m.gguf')\nexcept Exception as e:\n"
            "    print(type(e).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "VerispecError", r.stderr[-500:]
    assert -r.returncode != signal.SIGILL
