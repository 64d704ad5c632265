"""Native kernels, built on first use with torch's ``cpp_extension`` where this machine can (a C++ compiler, ninja and
the instructions each needs: AVX-512 for ``attention()``, AVX2 and FMA for the others, and F16C for ``linear()``);
everything has a pure-torch path for machines that cannot (each returns None there).

``attention()``: the lean forward's bfloat16 attention over a bfloat16 cache (``attention.cpp``): two products
reading the cache in half the bytes, with float32 arithmetic in a fixed order, so that a row's result never depends
on its batch. Measured here (``scripts/experiments/bf16_attention_kernel.py``, 30 layers' caches read from
memory): 8 sequences at 600 entries of context, one decoding row each, 15 against 30 ms; 64 at 300, 75 against
136 ms. Each row stops at its last visible key, so a prompt chunk costs half its square.

``attention_f32()``: the lean forward's float32 attention on an AVX2 + FMA CPU (``attention_f32.cpp``): scores,
softmax and weighted sum of one query row in one call, a (slot, head) pair's rows one after another so that its keys
and values come from memory once, each row stopping at its last visible key; a row's result never depends on its
batch. Measured here (AMD EPYC Zen 3, 2 threads, 30 layers' caches read from memory, 3 key/value heads, 3 query
heads each; ``/tmp`` probe at the commit that added it): 8 sequences at 400 entries, 1 / 2 / 4 rows each, 11.6 /
12.9 / 19.5 ms against 23.3 / 25.1 / 27.3 for torch's batched products and softmax; one sequence of one row 1.1
against 3.9.

``linear()``: float32 linear layers on an AVX2 + FMA CPU (``linear.cpp``): the weight packed once into panels of 16
output columns, each pass over a panel keeping 6 rows' sums in registers, the panels split over torch's threads. A
row's result never depends on its batch (one chain of fused multiply-adds per output, in order). Measured here (AMD
EPYC Zen 3, 2 threads, SmolLM2-135M's 210 decoder matrices streamed from memory, ``scripts/experiments/
native_linear.py``): 1 row 20.7 ms against MKL's 33.2, 8 rows 24.9 against 50.8, 16 rows 39.8 against 60.9, 136 rows
(a prompt chunk beside 8 decoding rows) 178 against 210. On an AVX-512 CPU the same file is built with its 512-bit
paths as well (``linear_avx512``; docs/design.md, "The default model's weights stream from their GGUF blocks"): the
same results bit for bit, 4 to 16 rows faster.

``layer()``: a float32 model's decoder layers in one call (``layer.cpp``, built with ``linear()``'s flags): the files
above compiled into it, its own RMS norm and SiLU(gate) * up (``rms_norm``, ``silu_mul``, which the lean forward's
Python loop calls too) and the residual sums in place, so the loop's results bit for bit without some 20 Python calls
a layer (docs/design.md, "The decoder layers in one call", "The lean forward's own RMS norm").
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..cpu import cpu_flags

DISABLE = "VERISPEC_NO_NATIVE"  # set (to anything) to run the pure-torch paths
HOME = "VERISPEC_KERNELS"  # where the builds live (default: ~/.cache/verispec/kernels, or $XDG_CACHE_HOME's)
NAME = "verispec_attention_v3"  # raised with attention.cpp's interface or flags, so that an older build is never loaded
LINEAR_NAME = "verispec_linear_v6"  # the same for linear.cpp
LINEAR512_NAME = "verispec_linear512_v1"  # the same for linear.cpp's build with its 512-bit paths
ATTENTION_F32_NAME = "verispec_attention_f32_v2"  # the same for attention_f32.cpp
ROPE_NAME = "verispec_rope_v1"  # the same for rope.cpp
# layer.cpp compiles linear.cpp, attention_f32.cpp and rope.cpp into itself: its builds are named by the four files'
# contents (``layer_name``), so that a change to any of them builds it again
LAYER_SOURCES = ("layer.cpp", "linear.cpp", "attention_f32.cpp", "rope.cpp")
# a build takes 10-90 s here (``layer()``'s the longest): a lock file older than this was left by a build that was
# killed
STALE_LOCK_S = 300


def clear_stale_lock(build_dir: Path, now: float) -> bool:
    """Remove torch's build lock in ``build_dir`` if it is older than ``STALE_LOCK_S`` (a process killed while it
    built leaves it, and the next one would wait on it forever, silently); True if it did."""
    lock = build_dir / "lock"
    try:
        if now - lock.stat().st_mtime <= STALE_LOCK_S:
            return False
        lock.unlink()
    except OSError:  # no lock, or another process removed it first
        return False
    print(f"verispec: removed a stale build lock ({lock}) left by a killed build", file=sys.stderr, flush=True)
    return True


def kernels_home() -> Path:
    """The folder every checkout and virtual environment of this user shares for its builds."""
    if os.environ.get(HOME):
        return Path(os.environ[HOME])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "verispec" / "kernels"


@functools.lru_cache(maxsize=None)
def _compiler() -> str:
    """The C++ compiler's first line of ``--version`` (a new compiler builds anew)."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def build_dir(name: str, sources: tuple[str, ...], cflags: list[str]) -> Path:
    """The folder of ``name``'s build: keyed by what decides the built file -- the sources' contents, the flags, the
    torch and Python versions, the compiler and this CPU's instruction sets -- so that any number of checkouts
    share one build, and a checkout never loads, or rebuilds over, a build made from other sources or for another
    machine."""
    import torch  # noqa: PLC0415 - its version keys the build

    key = hashlib.sha256()
    for source in sources:
        key.update(source.encode() + b"\0" + Path(__file__).with_name(source).read_bytes() + b"\0")
    key.update(repr((cflags, torch.__version__, sys.version_info[:2], _compiler(),
                     sorted(cpu_flags()))).encode())
    return kernels_home() / f"{name}-{key.hexdigest()[:16]}"


def _sources_in(folder: Path, sources: tuple[str, ...]) -> list[str]:
    """The sources copied into ``folder/src`` (once: its key holds their contents), so that every checkout builds
    from the same paths and ninja finds the build up to date whichever checkout asks."""
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for source in sources:
        if not (src / source).exists():
            tmp = src / f".{source}.{os.getpid()}"
            shutil.copyfile(Path(__file__).with_name(source), tmp)
            os.replace(tmp, src / source)
    return [str(src / sources[0])]


# about how long each build takes alone on 2 cores of an AMD EPYC with g++ 12 (the first run at 910740d built the
# four the default model uses one after another in about 90 s; ``verispec kernels`` builds them side by side in
# about 50): the estimate a build prints
BUILD_SECONDS = {"attention kernels": 20, "linear kernel": 25, "512-bit linear kernel": 30,
                 "float32 attention kernel": 15, "rotary kernel": 10, "decoder layer kernel": 45}


class _Ticker:
    """While a build runs, one line on stderr saying what is built, how long it has taken and about how long it
    takes; on a terminal the line counts the seconds up."""

    def __init__(self, what: str):
        self.what, self.start, self._stop = what, time.perf_counter(), threading.Event()
        self.tty = sys.stderr.isatty()
        estimate = BUILD_SECONDS.get(what)
        self.about = f", about {estimate} s" if estimate else ""

    def __enter__(self):
        print(f"verispec: building the native {self.what} (once per machine{self.about}) ...", file=sys.stderr,
              flush=True)
        if self.tty:
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            print(f"\r  {self.what}: {time.perf_counter() - self.start:.0f} s", end="", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self._stop.set()
        took = time.perf_counter() - self.start
        end = "\n" if self.tty else ""
        print(f"{end}verispec: the native {self.what} {'failed to build' if exc[0] else 'built'} in {took:.0f} s",
              file=sys.stderr, flush=True)
        return False


def _import(name: str, path: Path):
    """The extension module built at ``path``. torch's ``load`` would run ninja first, whose command names the
    building virtual environment's include folders, so another checkout's environment would build it again; the
    folder's key already says the file is the one these sources, flags, torch, compiler and CPU make."""
    import importlib.util  # noqa: PLC0415

    import torch  # noqa: F401, PLC0415 - the extension's symbols come from torch's libraries, loaded first

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, source: str | tuple[str, ...], flags: set[str], cflags: list[str], what: str):
    """The extension ``name`` built from ``source`` (next to this file; a tuple: the first includes the others) in
    its keyed folder (``build_dir``), or None where this CPU lacks ``flags``, there is no compiler or ninja, the
    build fails or ``VERISPEC_NO_NATIVE`` is set."""
    if os.environ.get(DISABLE) or not flags <= cpu_flags() or shutil.which("ninja") is None \
            or shutil.which(os.environ.get("CXX", "c++")) is None:
        return None
    sources = (source,) if isinstance(source, str) else tuple(source)
    try:
        from torch.utils.cpp_extension import load  # noqa: PLC0415 - only where it is built

        cflags = ["-O3", *cflags]
        folder = build_dir(name, sources, cflags)
        paths = _sources_in(folder, sources)
        clear_stale_lock(folder, time.time())

        built = folder / f"{name}.so"
        if built.exists():  # made from these very sources and flags for this torch, compiler and CPU: load it as it is
            try:
                return _import(name, built)
            except Exception:  # noqa: BLE001 - a broken file: build it again below
                pass
        with _Ticker(what):
            return load(name, paths, extra_cflags=cflags, extra_ldflags=[f for f in cflags if f == "-fopenmp"],
                        build_directory=str(folder), verbose=False)
    except Exception:  # noqa: BLE001 - any failure to build means the pure-torch path
        return None


@functools.lru_cache(maxsize=None)
def attention():
    """The built attention kernels (``scores``, ``weighted``), or None where they cannot be built or run here."""
    return _build(NAME, "attention.cpp", {"avx512f", "avx512bw"}, ["-mavx512f", "-mavx512bw", "-mfma", "-fopenmp"],
                  "attention kernels")


AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@functools.lru_cache(maxsize=None)
def linear_avx2():
    """linear.cpp built for AVX2, FMA and F16C (256-bit registers), or None where it cannot be built or run here."""
    return _build(LINEAR_NAME, "linear.cpp", {"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                  "linear kernel")


@functools.lru_cache(maxsize=None)
def linear_avx512():
    """linear.cpp built with its 512-bit paths as well (``__AVX512F__``: up to 16 rows against GGUF blocks, 8 against
    float panels, in one pass), or None where this CPU lacks AVX-512 or it cannot be built. The same results as
    ``linear_avx2``'s bit for bit."""
    return _build(LINEAR512_NAME, "linear.cpp", {"avx2", "fma", "f16c", *AVX512},
                  ["-mavx2", "-mfma", "-mf16c", *(f"-m{f}" for f in AVX512), "-fopenmp"], "512-bit linear kernel")


def linear():
    """The float32 linear kernel (``pack``, ``pack_half``, ``pack_exact``, ``linear``) for this CPU: the 512-bit build
    where it runs, else the 256-bit one; None where neither can be built or run here."""
    return linear_avx512() or linear_avx2()


def linear_name() -> str | None:
    """The name of the build ``linear()`` gives (what a cost table or kernel plan measured with it is keyed by)."""
    return None if linear() is None else LINEAR512_NAME if linear_avx512() is not None else LINEAR_NAME


@functools.lru_cache(maxsize=None)
def attention_f32():
    """The built float32 attention kernel (``attend``: scores, softmax and weighted sum over a float32 cache), or None
    where it cannot be built or run here."""
    return _build(ATTENTION_F32_NAME, "attention_f32.cpp", {"avx2", "fma"}, ["-mavx2", "-mfma", "-fopenmp"],
                  "float32 attention kernel")


@functools.lru_cache(maxsize=None)
def rope():
    """The built rotary kernel (``rope_``: float32 rotary positions in place, torch's roundings), or None where it
    cannot be built here."""
    return _build(ROPE_NAME, "rope.cpp", set(), ["-ffp-contract=off"], "rotary kernel")


def layer_name(wide: bool | None = None) -> str:
    """The name of ``layer()``'s build for this CPU (512-bit paths or not; ``wide``, default: whether
    ``linear_avx512()`` builds) and the sources it is made of."""
    wide = linear_avx512() is not None if wide is None else wide
    digest = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes() for f in LAYER_SOURCES)).hexdigest()
    return f"verispec_layer{'512' if wide else ''}_{digest[:12]}"


@functools.lru_cache(maxsize=None)
def _build_layer(wide: bool):
    """layer.cpp built with or without the 512-bit paths."""
    flags = {"avx2", "fma", "f16c", *(AVX512 if wide else ())}
    return _build(layer_name(wide), LAYER_SOURCES, flags,
                  ["-mavx2", "-mfma", "-mf16c", *(f"-m{f}" for f in AVX512 if wide), "-fopenmp"],
                  "decoder layer kernel")


@functools.lru_cache(maxsize=None)
def layer():
    """The built float32 decoder layers (``layers``: a model's decoder layers in one call, the lean forward's Python
    loop over the linear, rotary and attention kernels above bit for bit; ``rms_norm`` and ``silu_mul``: the float32
    norm and SiLU(gate) * up both use),
    built with the flags of ``linear()``'s build; None where any of those kernels cannot be built or run here."""
    if linear() is None or attention_f32() is None or rope() is None:
        return None
    return _build_layer(linear_avx512() is not None)


def build_all() -> dict[str, bool]:
    """Build every kernel the default model's forward runs on this machine, at once (one thread each: the compilers
    run side by side, the decoder layers' -- the longest -- from the start), and say which are here: {kernel: built}.
    What ``scripts/install.sh`` runs (``verispec kernels``), so that the first generation builds nothing. The
    bfloat16 attention, for the lean forward's bfloat16 cache only, is built where it is first used."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    wide = set(AVX512) <= cpu_flags()
    jobs = {"decoder layers": lambda: _build_layer(wide) or _build_layer(False),
            "float32 attention": attention_f32, "rotary positions": rope,
            "float32 linear": lambda: linear_avx512() or linear_avx2()}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {what: pool.submit(job) for what, job in jobs.items()}
        built = {what: f.result() is not None for what, f in futures.items()}
    built["decoder layers"] = layer() is not None  # the build that matches the linear kernel that built
    return built
