"""Build llama-cpp-python (the ``[llama]`` extra) for the instruction sets this CPU really executes, then prove it.

    .venv/bin/python scripts/llama_build.py options     # what this CPU runs, and the CMAKE_ARGS that follow
    .venv/bin/python scripts/llama_build.py install     # build (or reuse a wheel built with the same options),
                                                         # install into this Python, self-test
    .venv/bin/python scripts/llama_build.py selftest    # the self-test alone
    .venv/bin/python scripts/llama_build.py server      # llama.cpp's own llama-server, built with cmake from the
                                                         # source llama-cpp-python vendors, with the same options

Why not ``pip install 'verispec[llama]'``: pip builds llama.cpp with ``GGML_NATIVE`` (``-march=native``), and on
some virtual machines the CPU advertises instructions that then fault (a Xeon with AMX: "Illegal instruction" on any
prompt batch), and pip caches the built wheel by version alone, so a rebuild with other ``CMAKE_ARGS`` silently
reinstalls the old binary. Here every instruction set is *executed* by a tiny probe program before it is enabled
(``-DGGML_NATIVE=OFF`` and one option per set), wheels are kept under a key of their exact options
(``$VERISPEC_CACHE/llama-wheels/``), and the install ends with a self-test: a 200-token prompt decoded by
llama-cpp-python and by verispec's backend, each in its own process. If the self-test dies on a signal with AMX
enabled, the build is redone once without AMX; if it still fails, the package is uninstalled and the script exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python release verispec is tested with
ROOT = Path(__file__).resolve().parents[1]

# (GGML option, /proc/cpuinfo flags it needs, gcc flags, a C body executing one of its instructions; `v` is a
# volatile int the compiler cannot fold)
_AVX512 = "-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw"
PROBES = [
    ("SSE42", ["sse4_2"], "-msse4.2", "return (int)_mm_crc32_u32(v, 7) == 12345;"),
    ("AVX", ["avx"], "-mavx", "__m256 a = _mm256_set1_ps(v); a = _mm256_add_ps(a, a); return _mm256_cvtss_f32(a) == 3;"),
    ("AVX2", ["avx2"], "-mavx2", "__m256i a = _mm256_set1_epi32(v); a = _mm256_add_epi32(a, a);"
     " return _mm256_extract_epi32(a, 0) == 3;"),
    ("FMA", ["fma"], "-mfma", "__m256 a = _mm256_set1_ps(v); a = _mm256_fmadd_ps(a, a, a); return _mm256_cvtss_f32(a) == 3;"),
    ("F16C", ["f16c"], "-mf16c", "__m128 a = _mm_cvtph_ps(_mm_set1_epi16(v)); return _mm_cvtss_f32(a) == 3;"),
    ("BMI2", ["bmi2"], "-mbmi2", "return (int)_pdep_u32(v, 0xff) == 12345;"),
    ("AVX_VNNI", ["avx_vnni"], "-mavxvnni", "__m256i a = _mm256_set1_epi32(v);"
     " a = _mm256_dpbusd_avx_epi32(a, a, a); return _mm256_extract_epi32(a, 0) == 3;"),
    ("AVX512", ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"], _AVX512,
     "__m512i a = _mm512_set1_epi8(v); a = _mm512_add_epi8(a, a); __m512d d = _mm512_and_pd(_mm512_set1_pd(v),"
     " _mm512_set1_pd(v)); __m256i c = _mm256_conflict_epi32(_mm256_set1_epi32(v));"
     " return _mm512_reduce_add_epi32(a) == 3 || _mm512_reduce_add_pd(d) == 3 || _mm256_extract_epi32(c, 1) == 9;"),
    ("AVX512_VBMI", ["avx512vbmi"], _AVX512 + " -mavx512vbmi", "__m512i a = _mm512_set1_epi8(v);"
     " a = _mm512_permutexvar_epi8(a, a); return _mm512_reduce_add_epi32(a) == 3;"),
    ("AVX512_VNNI", ["avx512_vnni"], _AVX512 + " -mavx512vnni", "__m512i a = _mm512_set1_epi32(v);"
     " a = _mm512_dpbusd_epi32(a, a, a); return _mm512_reduce_add_epi32(a) == 3;"),
    ("AVX512_BF16", ["avx512_bf16"], _AVX512 + " -mavx512bf16", "__m512 a = _mm512_set1_ps(v);"
     " __m512bh b = _mm512_cvtne2ps_pbh(a, a); __m512 c = _mm512_dpbf16_ps(a, b, b);"
     " return _mm512_reduce_add_ps(c) == 3;"),
]
# AMX: the kernel must grant the tile data state (arch_prctl) and the tile instructions must run
_AMX_BODY = r"""
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
  struct { unsigned char palette, start; unsigned char pad[14]; unsigned short colsb[16]; unsigned char rows[16]; }
      __attribute__((aligned(64))) cfg = {0};
  cfg.palette = 1;
  for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  static signed char a[16 * 64] __attribute__((aligned(64)));
  static int c[16 * 16] __attribute__((aligned(64)));
  a[0] = v;
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, a, 64);
  BODY
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0] == 12345;
"""
AMX_PROBES = [
    ("AMX_TILE", ["amx_tile"], "-mamx-tile", _AMX_BODY.replace("BODY", "")),
    ("AMX_INT8", ["amx_tile", "amx_int8"], "-mamx-tile -mamx-int8", _AMX_BODY.replace("BODY", "_tile_dpbssd(0, 1, 2);")),
    ("AMX_BF16", ["amx_tile", "amx_bf16"], "-mamx-tile -mamx-bf16", _AMX_BODY.replace("BODY", "_tile_dpbf16ps(0, 1, 2);")),
]
ALL_OPTIONS = [p[0] for p in PROBES + AMX_PROBES]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def probe(option: str, gcc_flags: str, body: str, workdir: Path) -> tuple[bool, str]:
    """Compile and run a program that executes ``option``'s instructions; True if it exits 0."""
    src = workdir / f"{option}.c"
    exe = workdir / option
    src.write_text("#define _GNU_SOURCE\n#include <immintrin.h>\n#include <unistd.h>\n#include <sys/syscall.h>\n"
                   f"int main(int argc, char **argv) {{ (void)argv; volatile int v = argc + 1;\n{body}\n}}\n")
    cc = os.environ.get("CC", "cc")
    built = subprocess.run([cc, "-O1", *gcc_flags.split(), str(src), "-o", str(exe)], capture_output=True, text=True)
    if built.returncode != 0:
        return False, "the compiler cannot build it"
    ran = subprocess.run([str(exe)], capture_output=True, timeout=30)
    if ran.returncode == 0:
        return True, "runs"
    if ran.returncode < 0:
        return False, f"killed by {signal.Signals(-ran.returncode).name}"
    return False, f"exit {ran.returncode}"


def usable_features(without: set[str]) -> dict[str, tuple[bool, str]]:
    """Each GGML option: (enable it?, why). Enabled iff the CPU advertises it, it runs, and ``without`` allows it."""
    flags = cpu_flags()
    out: dict[str, tuple[bool, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for option, needs, gcc_flags, body in PROBES + AMX_PROBES:
            if option in without or (option.startswith("AMX") and "AMX" in without):
                out[option] = (False, "turned off (--without)")
            elif not all(f in flags for f in needs):
                out[option] = (False, "not advertised by the CPU")
            else:
                ok, why = probe(option, gcc_flags, body, Path(tmp))
                out[option] = (ok, why)
    return out


def cmake_args(features: dict[str, tuple[bool, str]]) -> str:
    parts = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{k}={'ON' if on else 'OFF'}" for k, (on, _) in features.items()]
    return " ".join(parts)


def wheel_dir(version: str, args: str) -> Path:
    root = Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))
    key = hashlib.sha256(f"{version} {args} {platform.machine()} {sys.version_info[:2]}".encode()).hexdigest()[:16]
    return root / "llama-wheels" / f"{version}-{key}"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def build_and_install(version: str, args: str, rebuild: bool) -> Path:
    """A wheel built with exactly ``args`` (cached under a key of them, never pip's version-keyed cache), installed."""
    out = wheel_dir(version, args)
    wheels = sorted(out.glob("llama_cpp_python-*.whl")) if out.is_dir() else []
    if rebuild or not wheels:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "cmake_args.txt").write_text(args + "\n")
        env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        print(f"building llama-cpp-python {version} from source (about 15 minutes on 2 cores) into {out}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps",
                        "--no-cache-dir", "--no-binary", "llama-cpp-python", "-w", str(out),
                        f"llama-cpp-python=={version}"], env=env, check=True)
        wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    else:
        print(f"reusing the wheel built with these options: {wheels[-1]}", flush=True)
    pip("install", "--quiet", "--no-deps", "--force-reinstall", str(wheels[-1]))
    # its own dependencies, if any are missing, and its server's (llama_cpp.server: a benchmark peer of verispec serve)
    pip("install", "--quiet", f"{wheels[-1]}[server]")
    return wheels[-1]


SELFTEST_LLAMA = r"""
import sys, llama_cpp
from verispec.backends.loading import BUILTIN_MODELS
import os
folder, name = BUILTIN_MODELS["smollm2-135m"]()
llm = llama_cpp.Llama(model_path=os.path.join(folder, name), n_ctx=1024, n_batch=512, verbose=False)
prompt = llm.tokenize(("The river runs to the sea and the sea to the sky. " * 20).encode())[:200]
assert len(prompt) == 200, len(prompt)
out = llm(prompt, max_tokens=8, temperature=0.0)
print("llama-cpp-python:", len(prompt), "prompt tokens ->", repr(out["choices"][0]["text"]))
"""

SELFTEST_VERISPEC = r"""
import verispec, torch
from verispec.backends.llama import check_engine
target = verispec.load(backend="llama")
check_engine(target.path, use_cache=False)  # the load-time check itself, uncached
ids = target.tokenizer("The river runs to the sea and the sea to the sky. " * 20)["input_ids"][:200]
state = target.new_state()
logits = target.prefill(state, ids)
tree = verispec.Tree.parse("2x2")
tokens = torch.tensor([int(logits.argmax())] + [100 + i for i in range(tree.size - 1)])
out = target.forward(state, tokens, state.committed + torch.tensor(tree.depths), tree.ancestors_mask())
assert out.logits.shape == (tree.size, target.vocab_size)
print("verispec llama backend:", len(ids), "prompt tokens and a", tree.size, "node tree decoded")
"""


def selftest() -> tuple[bool, bool, str]:
    """(passed, died on a signal, message): both self-tests, each in a fresh process."""
    for name, code in (("llama-cpp-python", SELFTEST_LLAMA), ("verispec", SELFTEST_VERISPEC)):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
        sys.stdout.write(run.stdout)
        if run.returncode != 0:
            if run.returncode < 0:
                sig = signal.Signals(-run.returncode).name
                return False, True, f"the {name} self-test was killed by {sig} (a 200-token prompt decode)"
            tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
            return False, False, f"the {name} self-test failed: {tail}"
    return True, False, "self-test passed"


def system_info() -> str:
    run = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info()"
                          ".decode())"], capture_output=True, text=True)
    return run.stdout.strip()


def stamp(args: str, wheel: Path | None) -> None:
    info = {"llama_cpp_python": VERSION, "cmake_args": args, "wheel": str(wheel) if wheel else None,
            "cpu": cpu_model(), "system_info": system_info()}
    path = Path(sys.prefix) / "verispec-llama-build.json"
    path.write_text(json.dumps(info, indent=1) + "\n")
    print(f"build options recorded in {path}")


def server_dir(version: str, args: str) -> Path:
    return wheel_dir(version, args).parent.parent / "llama-server" / wheel_dir(version, args).name


def build_server(version: str, args: str, rebuild: bool) -> Path:
    """``llama-server`` from the llama.cpp source that llama-cpp-python ``version``'s sdist vendors, built by cmake with
    exactly ``args`` (the options of the extra): the benchmark's strongest CPU peer, continuous batching in C++. Kept
    under a key of its options; returns the binary's path (also written to ``$VERISPEC_CACHE/llama-server/current``)."""
    out = server_dir(version, args)
    binary = out / "build" / "bin" / "llama-server"
    if binary.is_file() and not rebuild:
        print(f"reusing {binary}")
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        print(f"building llama-server from llama-cpp-python {version}'s sources (about 10 minutes on 2 cores)",
              flush=True)
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
                        "--no-binary", ":all:", "-d", str(out),
                        f"llama-cpp-python=={version}"], check=True)
        sdist = next(out.glob("llama_cpp_python-*.tar.gz"))
        shutil.unpack_archive(str(sdist), str(out))
        source = next(out.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = out / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
                        *args.split()], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True)
        (out / "cmake_args.txt").write_text(args + "\n")
    current = out.parent / "current"
    current.write_text(str(binary) + "\n")
    print(f"llama-server: {binary} (recorded in {current})")
    return binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("options", "install", "selftest", "server"))
    ap.add_argument("--without", nargs="*", default=[], metavar="OPTION",
                    help=f"leave these instruction sets off even if they run ({', '.join(ALL_OPTIONS)}; AMX = all "
                         "three AMX options)")
    ap.add_argument("--rebuild", action="store_true", help="build again even if a wheel with these options exists")
    ap.add_argument("--version", default=VERSION, help=f"llama-cpp-python release (default {VERSION}, the tested one)")
    a = ap.parse_args(argv)
    without = {w.upper().replace("-", "_") for w in a.without}
    unknown = without - set(ALL_OPTIONS) - {"AMX"}
    if unknown:
        ap.error(f"unknown instruction sets {sorted(unknown)}; choose from {', '.join(ALL_OPTIONS)} or AMX")
    if a.command == "selftest":
        ok, _, msg = selftest()
        print(msg)
        return 0 if ok else 1
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"{platform.machine()}: no probes for this architecture; building with llama.cpp's defaults")
        features = {}
    else:
        print(f"CPU: {cpu_model()}")
        features = usable_features(without)
        for option, (on, why) in features.items():
            print(f"  {option:12s} {'ON ' if on else 'off'}  {why}")
    args = cmake_args(features) if features else ""
    print(f"CMAKE_ARGS={args}")
    if a.command == "options":
        return 0
    if a.command == "server":
        build_server(a.version, args, a.rebuild)
        return 0
    wheel = build_and_install(a.version, args, a.rebuild)
    ok, crashed, msg = selftest()
    amx_on = any(on for k, (on, _) in features.items() if k.startswith("AMX"))
    if not ok and crashed and amx_on:
        print(f"{msg}; building once more without AMX")
        features = {k: (False, "turned off after a crash") if k.startswith("AMX") else v for k, v in features.items()}
        args = cmake_args(features)
        print(f"CMAKE_ARGS={args}")
        wheel = build_and_install(a.version, args, a.rebuild)
        ok, crashed, msg = selftest()
    if not ok:
        pip("uninstall", "--quiet", "-y", "llama-cpp-python")
        hint = (" Try leaving more instruction sets out, e.g. `bash scripts/install_llama.sh --without AVX512_BF16 "
                "AVX512_VNNI`, and report the output of `scripts/llama_build.py options`." if crashed else "")
        print(f"error: {msg}; llama-cpp-python was uninstalled so that nothing dies later.{hint}", file=sys.stderr)
        return 1
    stamp(args, wheel)
    print(f"llama.cpp installed and self-tested: {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
