"""Benchmarks: the runner (``verispec bench``), the records it writes (one format), the peers it runs beside
verispec (Hugging Face ``generate``, assisted generation, llama.cpp), task scoring, and the report and figures
derived from the records alone."""

from .records import NO_DRAFT, Results, read_records, read_step, step_record
from .runner import QUICK, BenchConfig, run_bench

__all__ = ["NO_DRAFT", "QUICK", "BenchConfig", "Results", "read_records", "read_step", "run_bench", "step_record"]
