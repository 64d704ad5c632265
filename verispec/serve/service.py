"""The engine behind a server: requests in from any thread, one engine thread stepping the batch, events out.

``Service`` owns an ``engine.Engine`` and the one thread that touches it: ``run`` steps the engine in the caller's
thread until ``stop`` (``serve.run`` calls it in the main thread, see there why), ``start`` runs it on a thread of
its own. ``submit`` checks a request at once in the
caller's thread (``Engine.check_request`` reads only the engine's fixed configuration), refuses it when the queue is
full (``QueueFull``), and hands it to the engine thread through an inbox; ``Handle.cancel`` does the same for a
cancellation, which the engine thread carries out before its next step, so a client that goes away frees its slot
within one step. After each step the engine thread turns every request's new tokens into text (whole characters
only, ``decode.TextStream``), cuts it at the first stop string (held back while the text could still be the start
of one, so a stop string split across tokens never shows), and calls the request's ``on_event`` with:

- ``("text", str, ids)``: new text (possibly empty: a character still incomplete) and the new tokens;
- ``("done", finish_reason, usage)``: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens``), with the
  request's token counts and its speculation figures (drafted and accepted tokens, mean accepted length);
- ``("error", message)``: the request failed alone (its step raised, or the engine refused it); the others go on.

A sequence's output law is the engine's: the service changes when work is done, never what a sequence computes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..backends import default_threads, kernels, load, resolve_dtype
from ..decode import TextStream
from ..drafters import DraftSpec, SuffixCache, build_drafter, with_answer_cache
from ..drafters.base import Drafter
from ..engine import Engine, run_all
from ..errors import VerispecError
from ..methods import Plan, resolve
from ..probs import Sampling
from ..sequence import Sequence


class QueueFull(VerispecError):
    """The service already holds ``max_queue`` requests waiting for a slot."""


class Starting(VerispecError):
    """The service is still measuring this machine's costs and warming up (``Service.warm``)."""


@dataclass(frozen=True)
class Request:
    """What one client asks for, in token ids (the API layer encodes text)."""

    prompt_ids: list[int]
    max_tokens: int | None  # None: as many as the context leaves
    sampling: Sampling
    seed: int
    stop: tuple[str, ...] = ()


Event = tuple


@dataclass(eq=False)
class Handle:
    """One request in flight. ``on_event`` is called from the engine thread (see the module docstring)."""

    request: Request
    on_event: Callable[[Event], None]
    service: "Service"
    seq: Sequence | None = None
    finished: bool = False
    _text: TextStream | None = None
    _shown: int = 0  # characters of the text already sent
    _tokens: int = 0  # tokens already turned into text
    _counted: int = 0  # steps already counted in the metrics
    created: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """End this request (the client went away): its slot is free before the next step."""
        self.service._inbox.put(("cancel", self))

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the client; a client that cannot take it any more (its event loop closed) is gone, and
        its request is cancelled."""
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - whatever the consumer raises, it is not the engine's failure
            if not self.finished:
                self.cancel()


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


@dataclass
class Metrics:
    """What ``GET /metrics`` reports (``serve.api.prometheus`` renders it), counted by the engine thread."""

    received: int = 0
    rejected: int = 0  # refused at submission (bad request, full queue)
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafts: int = 0  # steps that drafted something
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0  # sequence steps (one per running sequence per engine step)
    step_time: Histogram = field(default_factory=lambda: Histogram(_LATENCY))
    ttft: Histogram = field(default_factory=lambda: Histogram(_LATENCY))
    tpot: Histogram = field(default_factory=lambda: Histogram(_LATENCY))
    e2e: Histogram = field(default_factory=lambda: Histogram(_LATENCY))


class Service:
    """A ``Target``, a draft and a method, served to many clients at once (see the module docstring).

    Each request decodes with its own fork of ``drafter`` and the pieces ``plan.build`` makes for it (its own
    policy and learning state), seeded by the request. ``max_batch`` sequences share each target forward;
    ``max_queue`` more may wait; ``max_context`` (default: the model's) bounds a request's prompt and new tokens,
    and sizes the batch's caches once, up front. ``warm``: whether ``run`` first measures and warms up what the
    first batches would otherwise stop for (``warm``; requests are refused with ``Starting`` until then); ``log``
    tells its progress."""

    def __init__(self, target, drafter: Drafter, plan: Plan, *, max_batch: int = 8, max_queue: int = 64,
                 max_context: int | None = None, prefill_chunk: int | None = 128, load_aware: bool = True,
                 answer_cache: SuffixCache | None = None, warm: bool = True,
                 log: Callable[[str], None] = lambda msg: None):
        if max_queue < 0:
            raise VerispecError(f"max_queue must be >= 0, got {max_queue}")
        self.target, self.drafter, self.plan, self.max_queue = target, drafter, plan, max_queue
        self.engine = Engine(target, max_batch=max_batch, isolate=True, load_aware=load_aware,
                             max_context=max_context or target.max_context,
                             prefill_chunk=prefill_chunk if max_batch > 1 else None, answer_cache=answer_cache)
        self._recipe = plan.build(target, drafter)  # what a request is checked against (each builds its own)
        self.tree = self._recipe.tree
        self.metrics = Metrics()
        self._inbox: queue.Queue = queue.Queue()
        self._live: list[Handle] = []  # submitted and not yet finished (engine thread only)
        self._outstanding = 0  # submitted and not yet finished (running or waiting)
        self._lock = threading.Lock()  # guards _outstanding and the metrics while they are read
        self._thread: threading.Thread | None = None  # the engine's own thread, if ``start`` made one
        self._running = False  # ``run`` has begun and not yet ended
        self._stopping = threading.Event()
        self._warm, self.log = warm, log
        self._ready = threading.Event()  # set once ``run`` has warmed up (or failed doing so)
        self.failure: str | None = None  # set if the engine thread itself died (``healthy`` is then False)

    # ------------------------------------------------------------------ any thread

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def room(self) -> int:
        """The most prompt and new tokens one request may have together."""
        return self.engine.room(self.tree)

    @property
    def healthy(self) -> bool:
        return self._running and self._ready.is_set() and self.failure is None

    @property
    def starting(self) -> bool:
        """Running, and still warming up (``warm``)."""
        return self._running and not self._ready.is_set() and self.failure is None

    def queue_depth(self) -> int:
        """Requests submitted and not yet decoding (a prompt still being prefilled by chunks is decoding)."""
        return max(self._outstanding - len(self.engine.running), 0)

    def running(self) -> int:
        return len(self.engine.running)

    def start(self) -> "Service":
        """Run the engine on a thread of its own (``run`` there); returns once it takes requests (warmed up)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="verispec-engine", daemon=True)
            self._thread.start()
            while not self._ready.wait(0.1) and self._thread.is_alive():
                pass
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel whatever is left and end ``run`` (waiting at most ``timeout`` seconds for a thread of
        ``start``)."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Handle:
        """Check ``request`` now (``VerispecError`` with one sentence if it cannot run; ``QueueFull`` when
        ``max_queue`` requests already wait) and queue it; its events go to ``on_event``."""
        with self._lock:
            self.metrics.received += 1
        try:
            if self.starting:
                raise Starting("the server is starting (measuring this machine's costs); try again in a few seconds")
            if not self.healthy:
                raise VerispecError(f"the engine is not running ({self.failure or 'stopped'})")
            budget = request.max_tokens if request.max_tokens is not None else self.room - len(request.prompt_ids)
            if budget <= 0:
                self.engine.check_length(len(request.prompt_ids), 1, self.tree, "max_tokens")  # names the limit
            recipe = self._recipe
            self.engine.check_request(request.prompt_ids, budget, recipe, request.sampling, budget_name="max_tokens")
            with self._lock:
                if self._outstanding >= self.max_queue + self.engine.max_batch:
                    raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); try again later")
                self._outstanding += 1
        except VerispecError:
            with self._lock:
                self.metrics.rejected += 1
            raise
        handle = Handle(request, on_event, self)
        self._inbox.put(("submit", handle))
        return handle

    # ------------------------------------------------------------------ the engine thread

    def run(self, started: Callable[[], None] | None = None, ready: Callable[[], None] | None = None) -> None:
        """Step the engine in this thread until ``stop`` (or until the engine itself fails: ``failure`` says why);
        ``started()`` is called once the service is running, then it warms up (``warm``), and ``ready()`` once it
        takes requests. What is still running at the end fails with an error."""
        if self._running:
            raise VerispecError("the service is already running")
        self._running = True
        try:
            if started is not None:
                started()
            if self._warm:
                self.warm()
            self._ready.set()
            if ready is not None:
                ready()
            while True:
                self._drain(block=not self.engine.has_work)
                if self._stopping.is_set():
                    break
                if not self.engine.has_work:
                    continue
                t0 = time.perf_counter()
                ran = self.engine.step()
                dt = time.perf_counter() - t0
                with self._lock:
                    if ran:
                        self.metrics.step_time.observe(dt)
                self._deliver()
        except Exception as exc:  # noqa: BLE001 - the thread says why it died (health turns red), in one line
            self.failure = one_line(exc)
            print(f"verispec serve: the engine thread stopped: {self.failure}", file=sys.stderr)
        finally:
            self._ready.set()  # whoever waits for it learns the outcome
            why = "the server is shutting down" if self.failure is None else self.failure
            for h in list(self._live):  # stopping (or dead): whatever is left ends now
                if h.seq is not None and not h.seq.done:
                    self.engine.cancel(h.seq, "cancelled")
                self._end(h, "error", why)
            self._running = False
            while True:  # and so does what was submitted and never admitted
                try:
                    kind, h = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._end(h, "error", why)

    def warm(self) -> None:
        """Measure now what the first batches would otherwise stop to measure -- the target's batched forward, the
        drafts' and the verifier's costs (each once per machine, then cached on disk) -- and run a short request
        alone and a full batch, so that the first forwards' allocations and kernel choices are made too. A request
        never waits on a measurement; warm-up answers go in no answer cache."""
        t, engine = time.perf_counter(), self.engine
        plans = self._recipe.policy.expected_tokens(self.tree.max_depth) is not None  # the batch plan reads costs
        if engine.max_batch > 1 and engine.load_aware and self.plan.drafts and plans:
            self.log("measuring this machine's batch costs (once per machine, then cached) ...")
            engine.book.forward  # noqa: B018 - measured on first read
            engine.book.drafting(list((self.drafter.sources or {"": self.drafter}).values()))
            engine.book.verifying([(self.plan.verifier, Sampling(0.0)), (self.plan.verifier, Sampling(1.0))])
        self.log("warming up (/health answers 503 until ready) ...")
        cache, engine.answer_cache = engine.answer_cache, None
        try:
            prompt = self.target.encode_prompt("Say hello in three languages.", chat=False)
            for n in sorted({1, engine.max_batch}):
                for i in range(n):
                    engine.submit(prompt, self.plan.start(self.target, self.drafter), max_new_tokens=8, seed=i,
                                  sampling=Sampling(0.0 if i % 2 == 0 else 1.0))
                run_all(engine)
        finally:
            engine.answer_cache = cache
        # the largest forward: a prompt's chunk beside every other sequence's drafted tree
        rows = (engine.prefill_chunk or 128) + engine.max_batch * getattr(self.tree, "size", 8)
        if kernels.warm_packed(rows):
            self.log(f"compiled oneDNN's kernels for forwards of up to {rows} rows")
        self.log(f"ready after {time.perf_counter() - t:.1f}s of measuring and warming up")

    def _drain(self, block: bool) -> None:
        """Carry out what the inbox holds (waiting for one message when there is no work)."""
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = msg
            if kind == "submit":
                self._admit(handle)
            elif kind == "cancel" and not handle.finished:
                if handle.seq is not None:
                    self.engine.cancel(handle.seq)
                self._end(handle, None, "cancelled")
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, h: Handle) -> None:
        r = h.request
        try:
            budget = r.max_tokens if r.max_tokens is not None else self.room - len(r.prompt_ids)
            h.seq = self.engine.submit(r.prompt_ids, self.plan.start(self.target, self.drafter), sampling=r.sampling,
                                       max_new_tokens=budget, seed=r.seed, id=h)
        except VerispecError as exc:
            self._end(h, "error", str(exc))
            return
        h._text = TextStream(self.target.decode)
        with self._lock:
            self.metrics.prompt_tokens += len(r.prompt_ids)
        self._live.append(h)

    def _deliver(self) -> None:
        """Each live request's news since the last step: new text, its end, its failure. A request whose news
        cannot be told (its text does not decode, say) fails alone."""
        for h in list(self._live):
            try:
                self._tell(h)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own, never the engine thread's
                if h.seq is not None and not h.seq.done:
                    self.engine.cancel(h.seq, "error")
                self._end(h, "error", one_line(exc))

    def _tell(self, h: Handle) -> None:
        """One request's news: its text so far, and its end."""
        seq = h.seq
        new = seq.token_ids[h._tokens:]
        if new:
            h._tokens = len(seq.token_ids)
            self._count_steps(h)
            h._text.push(new)
            text, stopped = self._cut(h)
            h.emit(("text", text, new))
            if stopped:
                self.engine.cancel(seq, "stop")
                self._end(h, "stop")
                return
        if seq.done:
            if seq.stop_reason == "error":
                self._end(h, "error", seq.error or "the request failed")
                return
            h._text.flush()
            text, _ = self._cut(h, final=True)
            if text:
                h.emit(("text", text, []))
            self._end(h, "length" if seq.stop_reason == "max_new_tokens" else "stop")

    def _count_steps(self, h: Handle) -> None:
        with self._lock:
            for rec in h.seq.steps[h._counted:]:
                m = self.metrics
                m.steps += 1
                m.generation_tokens += len(rec.emitted)
                if rec.drafted:
                    m.drafts += 1
                    m.draft_tokens += rec.drafted
                    m.accepted_tokens += rec.accepted_length - 1
        h._counted = len(h.seq.steps)

    def _cut(self, h: Handle, final: bool = False) -> tuple[str, bool]:
        """The new part of the text that may be shown now: up to the first stop string (and then ``True``), else all
        but the end that could still grow into one (all of it when ``final``)."""
        stops, full = h.request.stop, h._text.text
        if stops:
            hits = [i for i in (full.find(s, max(0, h._shown - len(s) + 1)) for s in stops) if i >= 0]
            if hits:
                end = min(hits)
                out, h._shown = full[h._shown:end], max(h._shown, end)
                return out, True
        end = len(full) if final else len(full) - _held(full, stops)
        if end <= h._shown:
            return "", False
        out, h._shown = full[h._shown:end], end
        return out, False

    def _end(self, h: Handle, reason: str | None, error: str | None = None) -> None:
        """Send the request's last event (none for a cancelled one) and forget it, and its sequence: a finished
        handle may outlive its request in a reference cycle of the HTTP layer's (a timeout's traceback) until the
        garbage collector's next full pass, and its sequence's draft state and caches (a few MB) must not."""
        if h.finished:
            return
        h.finished = True
        if h in self._live:
            self._live.remove(h)
        with self._lock:
            self._outstanding -= 1
        try:
            self._last_event(h, reason, error)
        finally:
            h.seq = None

    def _last_event(self, h: Handle, reason: str | None, error: str | None) -> None:
        if reason == "error":
            with self._lock:
                self.metrics.finished["error"] += 1
            h.emit(("error", error or "the request failed"))
            return
        if reason is None:
            with self._lock:
                self.metrics.finished["abort"] += 1
            return
        usage = self.usage(h)
        with self._lock:
            m = self.metrics
            m.finished[reason] += 1
            seq = h.seq
            if seq.first_token is not None:
                m.ttft.observe(seq.first_token - seq.submitted)
                if usage["completion_tokens"] > 1 and seq.finished is not None:
                    m.tpot.observe((seq.finished - seq.first_token) / (usage["completion_tokens"] - 1))
            m.e2e.observe((seq.finished or time.perf_counter()) - seq.submitted)
        h.emit(("done", reason, usage))

    @staticmethod
    def usage(h: Handle) -> dict:
        """A request's token counts and speculation figures (the ``usage`` of its response)."""
        seq = h.seq
        steps = seq.steps if seq is not None else []
        drafted = sum(s.drafted for s in steps)
        accepted = sum(s.accepted_length - 1 for s in steps)
        completion = len(seq.token_ids) if seq is not None else 0
        return {
            "prompt_tokens": len(h.request.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(h.request.prompt_ids) + completion,
            "steps": len(steps), "drafted_tokens": drafted, "accepted_tokens": accepted,
            "mean_accepted_length": (accepted + len(steps)) / len(steps) if steps else None,
        }


def one_line(exc: BaseException) -> str:
    """What went wrong, as one line: the exception's type and the first line of its message."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _held(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (held back until known)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@dataclass(frozen=True)
class ServiceRecipe:
    """What ``verispec serve`` serves, as plain values (picklable: a Ray replica builds its own service from it).
    ``plan()`` checks the method without loading anything; ``recipe(info)`` loads the model and draft and makes the
    ``Service``, telling its progress to ``info``."""

    target: str
    backend: str = "hf"
    dtype: str = "auto"
    threads: int | None = None
    draft: str = "auto"
    method: str | None = None
    verifier: str | None = None
    policy: str | None = None
    tree: str | None = None
    children: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    max_context: int | None = None
    answer_cache: int = 100_000  # tokens of served answers kept for drafting (0: none)

    def plan(self, info: Callable[[str], None] | None = None) -> Plan:
        return resolve(self.method, verifier=self.verifier, policy=self.policy, tree=self.tree,
                       children=self.children, info=info)

    def __call__(self, info: Callable[[str], None] = lambda msg: None) -> Service:
        plan = self.plan()
        draft = DraftSpec.parse(self.draft if plan.drafts else "none")
        torch.set_num_threads(self.threads or default_threads())
        t = time.perf_counter()
        computes = "" if self.backend != "hf" else f", {resolve_dtype(self.dtype)}"
        info(f"loading target {self.target} ({self.backend}{computes}) ...")
        target = load(self.target, dtype=self.dtype, backend=self.backend, threads=self.threads)
        drafter = build_drafter(draft, target, dtype=self.dtype)
        cache = None
        if self.answer_cache and plan.drafts:
            cache = SuffixCache(target.vocab_size, max_tokens=self.answer_cache)
            drafter, reads = with_answer_cache(drafter, cache)
            if reads:
                info(f"drafting from the last {self.answer_cache} tokens of served answers too")
            else:
                cache = None
        service = Service(target, drafter, plan, max_batch=self.max_batch, max_queue=self.max_queue,
                          max_context=self.max_context, answer_cache=cache, log=info)
        info(f"loaded in {time.perf_counter() - t:.1f}s; draft {drafter.name}, verifier {plan.verifier.name}, "
             f"{service.tree.describe()}; up to {self.max_batch} sequences of {service.max_context} tokens")
        return service

