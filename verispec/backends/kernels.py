"""Float32 linear layers for decoding-sized inputs on a CPU: an explicit, reversible choice of kernel per row count.

A decoding step multiplies a handful of rows (one token, or a small draft tree) by every weight matrix. On the CPUs
measured here, MKL's ``x @ W^T`` takes a slow path for some of these shapes, and ``W @ x^T`` -- the rows as
columns, possibly padded with zero columns to a friendlier width -- can be much faster; which is faster depends on
the CPU and the row count. Where it builds (an AVX2 + FMA CPU with a C++ compiler), verispec's own kernel
(``native.linear``, ``NATIVE`` in a plan) streams a packed copy of the weight once for any number of rows, and each
row's result never depends on the rows beside it. A *plan* says, for each row count 1..``MAX_ROWS`` and for more rows
(its last entry), which kernel runs: ``NATIVE``, a number of columns to run ``W @ x^T`` with, or 0 (the stock
kernel). ``default_plan()`` is ``NATIVE`` throughout where the native kernel builds (measured faster at every row
count, 1 to 256, on an AVX2 EPYC: ``scripts/experiments/native_linear.py``), else ``DEFAULT_PLAN``;
``prompt_plan()``, what ``verispec.backends.load`` gives a float32 model, is that with the entry for more rows (a
prompt's) measured per machine (``prompt_entry``: MKL on an Intel Xeon with AVX-512).

* ``use_fast_linear(module, plan)`` switches the float32 ``nn.Linear`` layers of ``module`` to the plan and returns
  a function that switches them back; ``fast_linear(module)`` is the same as a context manager. Nothing changes a
  model behind its owner's back: ``verispec.backends.load`` applies it to the models it creates itself.
* ``calibrate(model)`` measures whole forwards of a ``CausalLM`` with each candidate at each row count and keeps
  the fastest; the plan is saved per CPU, torch version and weight shapes (``plan_for``), so it is measured once.

Results differ from ``x @ W^T`` by float rounding only. The native kernel packs a copy of each weight on first use
(the weights' size again in memory, as bfloat16's prepacked copies below), except a weight that GGUF de-quantisation
made from Q4_1 or Q8_0 blocks (the default model's every layer and its output head): that one goes back into its
blocks, which give it bit for bit (``_pack_exact``), a fifth of the bytes to keep and, above all, to stream through
each decoding step (``VERISPEC_FLOAT_PANELS=1``: float32 panels anyway, for comparisons). The plan never applies
with autograd on (training), on other devices or dtypes, or when ``VERISPEC_STOCK_LINEAR=1``.

bfloat16 layers have no plan: ``use_fast_linear`` runs them with oneDNN's linear on a copy of the weight prepacked
once into its blocked layout (``packed_rows``). Measured here (Zen 4, 2 threads, weights streamed from memory as in a
forward): 1.4-1.9x faster than ``F.linear`` on the same bfloat16 weights for 1-16 rows; the products equal
``F.linear``'s bit for bit on two or more rows, and each row's are the same whatever rows come with it (a
sequence's logits do not depend on what it is batched with). The copy costs the weights' size again in memory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import platform
import statistics
import time
import weakref

import torch
from torch import nn

from .. import cache
from ..tree import Tree
from . import native
from .cpu import cpu_name

MAX_ROWS = 16
NATIVE = -1  # a plan entry: verispec's own kernel (``native.linear``)
# Where the native kernel does not build, before calibration: one row as two equal columns, 2-8 rows as they are,
# 9-16 rows padded to 16 columns, more rows the stock kernel.
DEFAULT_PLAN = (0, 2, 2, 3, 4, 5, 6, 7, 8, 16, 16, 16, 16, 16, 16, 16, 16, 0)


def default_plan() -> tuple[int, ...]:
    """``NATIVE`` for every row count where the native kernel builds, else ``DEFAULT_PLAN``."""
    return (0,) + (NATIVE,) * (MAX_ROWS + 1) if native.linear() is not None else DEFAULT_PLAN


PROMPT_ROWS = 128  # the rows ``prompt_entry`` times: a prompt chunk's (``LeanLlama.PROMPT_BLOCK``)


def prompt_entry(repeats: int = 7) -> int:
    """What a float32 model's plan runs for more than ``MAX_ROWS`` rows (a prompt's): ``NATIVE`` where the native
    kernel builds and multiplies ``PROMPT_ROWS`` rows at least as fast as the stock kernel, else 0 (the stock one).
    Measured once per machine, torch version and thread count on two of the default model's layer shapes (576 x 1536
    and back, the native kernel on float32 panels), then cached: on an Intel Xeon with AVX-512 the stock kernel
    (MKL) ran these products at 280-360 GFLOPS, a whole 128-row forward 1.5x faster than the native kernel
    (``scripts/experiments/prompt_kernel.py``; on the AVX2 EPYC the native kernel was the faster at every row
    count)."""
    if native.linear() is None:
        return 0
    entry = cache.key(platform.processor() or platform.machine(), cpu_name(), os.cpu_count(), torch.get_num_threads(),
                      torch.__version__, native.linear_name(), PROMPT_ROWS)
    hit = cache.read("kernels", f"prompt-{entry}")
    if hit is not None and hit.get("entry") in (0, NATIVE):
        return int(hit["entry"])
    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(k, n, bias=False) for k, n in ((576, 1536), (1536, 576))]
    for layer in layers:
        layer.weight.requires_grad_(False).copy_(torch.randn(layer.weight.shape, generator=gen))
    candidates = {0: lambda x, layer: nn.functional.linear(x, layer.weight), NATIVE: native_rows}
    times: dict[int, list[float]] = {0: [], NATIVE: []}
    with torch.inference_mode():
        for layer in layers:
            x = torch.randn(PROMPT_ROWS, layer.in_features, generator=gen)
            for _ in range(repeats):
                for kind, run in candidates.items():
                    t = time.perf_counter()
                    run(x, layer)
                    times[kind].append(time.perf_counter() - t)
    ms = {kind: 1000 * statistics.median(ts) for kind, ts in times.items()}
    best = 0 if ms[0] < ms[NATIVE] else NATIVE
    cache.write("kernels", f"prompt-{entry}", {"entry": best, "ms": {str(k): v for k, v in ms.items()}})
    return best


def prompt_plan() -> tuple[int, ...]:
    """``default_plan()`` with its entry for more than ``MAX_ROWS`` rows measured (``prompt_entry``): what
    ``verispec.backends.load`` gives a float32 model. The lean forward runs a prompt's rows on that entry and every
    other row (draft trees, however many sequences' together) in the native kernel, whose rows do not depend on
    their company (``LeanLlama._prompt_runs``); a draft head keeps ``default_plan()``."""
    plan = default_plan()
    return plan[:-1] + (prompt_entry(),) if plan[-1] == NATIVE else plan


def planned_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """``x [n, K] @ weight^T + bias`` as ``weight @ x^T`` over ``width >= n`` columns (the first row repeated as
    padding); the result is row-major, so that the next layer reads it as ``W @ x^T`` again (a contiguous ``x^T``
    is MKL's slow case)."""
    rows = x.shape[0]
    if width > rows:
        x = torch.cat([x, x[:1].expand(width - rows, -1)])
    y = (weight @ x.T).T[:rows]
    return (y if bias is None else y + bias).contiguous()


FLOAT_PANELS = "VERISPEC_FLOAT_PANELS"  # set to 1: float32 panels even for a weight of de-quantised GGUF blocks


def _pack_exact(weight: torch.Tensor, half: bool = False) -> torch.Tensor:
    """The native kernel's panels for a float32 weight: its GGUF blocks where it is the de-quantisation of Q4_1 or
    Q8_0 blocks (``pack_exact``: the same results bit for bit from a fifth of the bytes), else float32 panels -- or,
    with ``half`` (a weight that may be rounded to float16, ``_verispec_half``), float16 ones."""
    kernel = native.linear()
    if os.environ.get(FLOAT_PANELS) != "1":
        panels = kernel.pack_exact(weight)
        if panels.numel():
            return panels
    return kernel.pack_half(weight) if half else kernel.pack(weight)


def q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (float32, K a multiple of 32) rounded to GGUF's Q8_0 blocks, as float32: each block of 32
    weights of a row becomes ``q * d``, d the float16 nearest its largest magnitude / 127 and q the integer nearest
    each weight / d (in [-128, 127]), products exact in float32. What ``pack_exact`` packs back into those blocks:
    1.125 bytes a weight where float16 panels take 2 (``native_rows``)."""
    if weight.dim() != 2 or weight.shape[1] % 32 or weight.dtype != torch.float32:
        raise ValueError("Q8_0 blocks round a float32 [N, K] weight with K a multiple of 32, not "
                         f"{tuple(weight.shape)} {weight.dtype}")
    blocks = weight.reshape(-1, 32)
    d = (blocks.abs().amax(1, keepdim=True) / 127).half().float()
    q = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))).clamp_(-128, 127)
    return (q.to(torch.int32).float() * d).reshape(weight.shape)  # through int: no -0.0, which no block gives


def native_rows(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``x [n, K] @ weight^T + bias`` in the native kernel, on a copy of the weight packed into its panels (made on
    first use and again whenever the weight is replaced or changed in place): the GGUF blocks it was de-quantised from
    where it was (``_pack_exact``), else float32 -- or, where the module is marked ``_verispec_half``
    (``use_fast_linear(half=True)``, a draft's rounding allowed), float16 panels instead of float32 ones (half the
    bytes to read, the same results for a weight of float16 values)."""
    panels, n, _ = native_args(module)
    return native.linear().linear(x.contiguous(), panels, n, module.bias)


def native_args(module: nn.Module) -> tuple[torch.Tensor, int, torch.Tensor]:
    """What ``native_rows`` passes the native kernel for ``module``: its panels, output width and bias (an empty
    tensor where it has none), for a native call that runs the layer itself (``native.layer``'s ``draft_depth``)."""
    half = bool(module.__dict__.get("_verispec_half"))
    panels = _prepacked(module, functools.partial(_pack_exact, half=half), "native-half" if half else "native")
    bias = module.bias
    return panels, module.weight.shape[0], torch.empty(0) if bias is None else bias.detach()


def native_calls(groups: list[tuple[nn.Module, ...]]) -> list[list[tuple]] | None:
    """The native kernel's calls for groups of float32 linear layers, the layers of a group reading the same rows:
    per group, a list of calls ``(panels, N, bias, widths)``. One call where the group's weights stack as one (its
    output, cut at ``widths``, is each layer's: every output column is its own chain of multiply-adds over its own
    panel, so bit for bit what the layer's own call gives); one call per layer where stacking would lose their GGUF
    blocks (layers of different block formats) or some have a bias and some not. A lone layer's panels are its own
    (``native_rows``'). None unless every layer is an ``nn.Linear`` of float32 weights under one plan
    (``use_fast_linear``'s) with one kind of panels (float16 ones or not) and the native kernel builds: the caller
    then runs the layers one by one as before."""
    kernel = native.linear()
    layers = [m for g in groups for m in g]
    plan = layers[0].__dict__.get("_verispec_plan") if layers else None
    half = bool(layers[0].__dict__.get("_verispec_half")) if layers else False
    if kernel is None or plan is None or any(
            type(m) is not nn.Linear or m.__dict__.get("_verispec_plan") is not plan or m.weight.dtype != torch.float32
            or bool(m.__dict__.get("_verispec_half")) != half for m in layers):
        return None
    pack = functools.partial(_pack_exact, half=half)
    kind = "native-half" if half else "native"
    out = []
    for group in groups:
        biased = {m.bias is not None for m in group}
        if len(group) > 1 and len(biased) == 1:
            panels = pack(torch.cat([m.weight.detach() for m in group]))
            if panels.dtype == torch.uint8 or pack(group[0].weight.detach()).dtype != torch.uint8:  # (a trial pack)
                bias = torch.cat([m.bias.detach() for m in group]) if biased == {True} else None
                out.append([(panels, sum(m.weight.shape[0] for m in group), bias,
                             tuple(m.weight.shape[0] for m in group))])
                continue
        out.append([(_prepacked(m, pack, kind), m.weight.shape[0], m.bias, (m.weight.shape[0],)) for m in group])
    return out


def plan_entry(plan: tuple[int, ...], rows: int) -> int:
    """What ``plan`` runs for ``rows`` rows."""
    return plan[rows] if rows <= MAX_ROWS else plan[-1]


def native_stamp(modules: list[nn.Module]) -> tuple:
    """What ``native_calls``' panels were made from: each layer (the module itself), its weight and bias (their
    storage and version), plan and kind of panels; they are made again when it changes."""
    out = []
    for m in modules:
        d, p = m.__dict__, m._parameters
        w, b = p["weight"], p.get("bias")
        out += (m, w.data_ptr(), w._version, d.get("_verispec_plan"), d.get("_verispec_half"),
                None if b is None else b.data_ptr(), None if b is None else b._version)
    return tuple(out)


def run_native(calls: list[tuple], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of one group's calls (``native_calls``) on rows ``x [n, K]``, one per layer."""
    kernel = native.linear()
    x = x.contiguous()
    outs = []
    for panels, n, bias, widths in calls:
        y = kernel.linear(x, panels, n, bias)
        outs += y.split(widths, 1) if len(widths) > 1 else (y,)
    return outs


def rows_forward(x: torch.Tensor, module: nn.Linear, plan: tuple[int, ...]) -> torch.Tensor:
    """A layer on rows ``x [n, K]`` under ``plan`` (inference only: the caller checks; a layer cast to another
    dtype after its plan was set runs the stock kernel where the plan says ``NATIVE``)."""
    width = plan_entry(plan, x.shape[0])
    if width == NATIVE:
        if module.weight.dtype == torch.float32:
            return native_rows(x, module)
        width = 0
    if width:
        return planned_rows(x, module.weight, module.bias, width)
    return nn.functional.linear(x, module.weight, module.bias)


def _planned_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows and x.device.type == "cpu" and x.dtype == self.weight.dtype and not torch.is_grad_enabled():
        y = rows_forward(x.reshape(rows, x.shape[-1]), self, self._verispec_plan)
        return y.view(*x.shape[:-1], y.shape[-1])
    return nn.functional.linear(x, self.weight, self.bias)


@functools.cache
def packing_available() -> bool:
    """Whether this torch and CPU run oneDNN's bfloat16 linear on a prepacked weight."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _prepacked(module: nn.Module, pack, kind: str) -> torch.Tensor:
    """``pack(weight)`` kept on ``module``: made on first use and again whenever the weight is replaced or changed in
    place (its storage or version differ) or another ``kind`` of packing is asked for."""
    w = module.weight
    stamp = (w.data_ptr(), w._version, kind)
    if module.__dict__.get("_verispec_stamp") != stamp:
        module._verispec_packed = pack(w.detach())
        module._verispec_stamp = stamp
    return module._verispec_packed


_ONEDNN_PACKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # every layer that has run in ``packed_rows``


def packed_width(rows: int) -> int:
    """The row count ``packed_rows`` runs ``rows`` rows as: one row as two, up to 8 as they are, then the next multiple
    of 8 (to 64), of 32 (to 256), of 128. oneDNN compiles a kernel for each row count and weight shape it sees and
    keeps them all (about 0.5 MB and 0.4 ms each here, up to 1,024 of them): a server meeting every prompt length
    and batch size grew by about 35 MiB every 64 requests, until this bounded the counts it sees."""
    if rows <= 8:
        return max(rows, 2)
    step = 8 if rows <= 64 else 32 if rows <= 256 else 128
    return -(-rows // step) * step


def packed_widths(max_rows: int) -> list[int]:
    """Every row count ``packed_rows`` runs for 1 to ``max_rows`` rows."""
    return sorted({packed_width(n) for n in range(1, max_rows + 1)})


def _onednn_pack(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    _ONEDNN_PACKED.add(module)
    return torch.ops.mkldnn._reorder_linear_weight(weight, 2)


def packed_rows(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """``x [n, K] @ weight^T + bias`` for a bfloat16 layer, with oneDNN's copy of the weight in its own blocked layout
    (made on first use and again whenever the weight is replaced or changed in place). The rows run as
    ``packed_width(n)`` rows, the first one repeated as padding. One row runs as two equal rows: for one row oneDNN
    takes a kernel that sums in another order on some layers (here: SmolLM2's 1536-wide down projection, on real
    activations though not on random ones), and a row's result would then depend on how many rows came with it
    (from 2 to 64 rows, each row's result is the same whatever its company: ``scripts/experiments/linear_rows.py``).
    Measured here: one row as two costs a one-sequence decoding step about 4 ms of 33."""
    packed = _prepacked(module, functools.partial(_onednn_pack, module), "onednn")
    rows = x.shape[0]
    if not rows:
        return x.new_empty(0, module.weight.shape[0])
    width = packed_width(rows)
    if width > rows:
        x = torch.cat([x, x[:1].expand(width - rows, -1)])
    y = torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
    return y[:rows] if width > rows else y


def warm_packed(max_rows: int) -> int:
    """Have oneDNN compile now the kernels ``packed_rows`` will ask for, for every layer that has run there and every
    row count up to ``max_rows``, rather than in the middle of a request (a server's warm-up); returns how many
    (weight shape, row count) pairs it ran."""
    seen, count = set(), 0
    for m in list(_ONEDNN_PACKED):
        key = (tuple(m.weight.shape), m.bias is None)
        if key in seen:
            continue
        seen.add(key)
        for width in packed_widths(max_rows):
            packed_rows(m.weight.new_zeros(width, m.weight.shape[1]), m)
            count += 1
    return count


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() and x.device.type == "cpu" and x.dtype == self.weight.dtype and not torch.is_grad_enabled():
        y = packed_rows(x.reshape(-1, x.shape[-1]), self)
        return y.view(*x.shape[:-1], y.shape[-1])
    return nn.functional.linear(x, self.weight, self.bias)


def use_fast_linear(module: nn.Module, plan: tuple[int, ...] | None = None, half: bool = False):
    """Run the float32 ``nn.Linear`` layers of ``module`` with ``plan`` (default ``default_plan()``) and its bfloat16
    ones on oneDNN's prepacked weights (``packed_rows``, where ``packing_available``); returns undo(). A plan's
    ``NATIVE`` entries run the stock kernel where the native one does not build. ``half``: the native kernel reads
    the weights from float16 panels (``native_rows``): for a draft head saved in float16, whose weights are float16
    values, the same results in half the bytes; any other weight rounded once."""
    if os.environ.get("VERISPEC_STOCK_LINEAR") == "1":
        return lambda: None
    plan = tuple(plan or default_plan())
    if len(plan) != MAX_ROWS + 2 or any(w != NATIVE and w and w < r for r, w in enumerate(plan[:-1])) \
            or plan[-1] not in (0, NATIVE):
        raise ValueError(f"a plan gives, for rows 0..{MAX_ROWS}, NATIVE ({NATIVE}), 0 or a width >= the row count, "
                         f"then NATIVE or 0 for more rows; got {plan}")
    if native.linear() is None:
        plan = tuple(0 if w == NATIVE else w for w in plan)
    pack = packing_available()
    changed = []
    for m in module.modules():
        if type(m) is not nn.Linear:
            continue
        if m.weight.dtype == torch.float32:
            changed.append((m, m.__dict__.get("forward"), m.__dict__.get("_verispec_plan")))
            m._verispec_plan = plan
            m.forward = _planned_forward.__get__(m)
            if half:
                m._verispec_half = True
        elif m.weight.dtype == torch.bfloat16 and pack:
            changed.append((m, m.__dict__.get("forward"), None))
            m.forward = _packed_forward.__get__(m)

    def undo() -> None:
        for m, forward, old_plan in reversed(changed):
            for name in ("_verispec_packed", "_verispec_stamp", "_verispec_half"):
                m.__dict__.pop(name, None)
            for name, value in (("forward", forward), ("_verispec_plan", old_plan)):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)

    return undo


KERNEL_STATE = ("forward", "_verispec_plan", "_verispec_packed", "_verispec_stamp", "_verispec_half")


def plain_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with the stock linear layers: no plan, no prepacked weight (oneDNN's copies cannot
    be deep-copied, and a copy is made to be changed)."""
    memo = {id(m.__dict__[name]): None for m in module.modules() for name in KERNEL_STATE if name in m.__dict__}
    out = copy.deepcopy(module, memo)
    for m in out.modules():
        for name in KERNEL_STATE:
            m.__dict__.pop(name, None)
    return out


@contextlib.contextmanager
def fast_linear(module: nn.Module, plan: tuple[int, ...] | None = None):
    """``use_fast_linear`` for the duration of a ``with`` block."""
    undo = use_fast_linear(module, plan)
    try:
        yield
    finally:
        undo()


def _plan_key(model) -> str:
    shapes = sorted({tuple(m.weight.shape) for m in model.hf.modules() if type(m) is nn.Linear})
    kernel = native.linear_name()
    return cache.key(platform.processor() or platform.machine(), cpu_name(), os.cpu_count(), torch.get_num_threads(),
                     torch.__version__, shapes, kernel)


def plan_for(model) -> tuple[int, ...] | None:
    """The plan ``calibrate`` saved for this CPU and these weight shapes, or None."""
    try:
        plan = tuple((cache.read("kernels", _plan_key(model)) or {})["plan"])
        return plan if len(plan) == MAX_ROWS + 2 else None
    except (KeyError, TypeError):
        return None


CALIBRATE_MORE = 128  # rows of the forward that decides the plan's last entry (a prompt chunk's size)


@torch.inference_mode()
def calibrate(model, repeats: int = 5, save: bool = True) -> dict:
    """Time whole forwards of ``model`` (a ``CausalLM``) over 1..``MAX_ROWS`` tree tokens with the stock kernel, with
    ``W @ x^T`` at each allowed width and with the native kernel where it builds, and over ``CALIBRATE_MORE`` rows
    with the stock and the native kernel; returns ``{"plan", "ms": {rows: {entry: ms}}}`` and saves the plan."""
    state = model.new_state()
    model.prefill(state, list(range(1, 65)))
    has_native = native.linear() is not None
    widths = sorted({0, *range(1, 9), 12, 16})
    ms: dict[int, dict[int, float]] = {}
    plan = [0]
    for rows in [*range(1, MAX_ROWS + 1), CALIBRATE_MORE]:
        tree = Tree.complete(rows - 1, 1) if rows > 1 else Tree.root_only()
        if rows > MAX_ROWS:  # a prompt chunk: each row sees the ones before it
            tree = Tree.chain(rows - 1)
        tokens = torch.full((rows,), 5)
        pos = state.committed + torch.tensor(tree.depths)
        mask = tree.ancestors_mask()
        ms[rows] = {}
        entries = [w for w in widths if w == 0 or max(rows, 2) <= w] if rows <= MAX_ROWS else [0]
        for w in entries + [NATIVE] * has_native:
            trial = [0] * (MAX_ROWS + 2)
            trial[rows if rows <= MAX_ROWS else -1] = w
            with fast_linear(model.hf, tuple(trial)):
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    model.forward(state, tokens, pos, mask)
                    times.append(time.perf_counter() - t)
                    model.commit(state, [])
            ms[rows][w] = 1000 * statistics.median(times)
        plan.append(min(ms[rows], key=ms[rows].get))
    out = {"plan": plan, "ms": ms, "cpu": cpu_name(), "threads": torch.get_num_threads()}
    if save:
        cache.write("kernels", _plan_key(model), out)
    return out
