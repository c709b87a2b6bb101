"""A progress line on the terminal while a job runs (rich).

Shown only when stderr is a terminal, never in JSON mode, and only once a
job has run for ``PROGRESS_DELAY_S`` (short runs stay quiet). It goes to
stderr so stdout carries the report alone.
"""
from __future__ import annotations

import sys
import time

from .units import format_bytes_iec

PROGRESS_DELAY_S = 1.0  # runs shorter than this print no progress line


class ProgressLine:
    def __init__(self, enabled: bool, jobname: str, total: float | None, unit: str, runtime_s: float):
        """``total`` is the work expected (bytes, keys or prompts); None when
        only the clock bounds the run (``time_based``)."""
        self.enabled = enabled and sys.stderr.isatty()
        self.jobname = jobname
        self.total = total
        self.unit = unit
        self.runtime_s = runtime_s
        self.start = time.monotonic()
        self._progress = None
        self._task = None

    def __enter__(self) -> "ProgressLine":
        return self

    def update(self, done: float) -> None:
        if not self.enabled:
            return
        if not done and self._progress is None:
            self.start = time.monotonic()  # the layout (untimed) is not the run: the clock starts with the work
            return
        elapsed = time.monotonic() - self.start
        if self._progress is None:
            if elapsed < PROGRESS_DELAY_S:
                return
            self._start()
        rate = done / elapsed if elapsed > 0 else 0.0
        rate_text = f"{format_bytes_iec(rate)}/s" if self.unit == "bytes" else f"{rate:,.0f} {self.unit}/s"
        if self.total is None and not self.runtime_s:
            completed, total = done, None  # neither work nor time is known: a pulsing bar
        elif self.total is None or (self.runtime_s and self.runtime_s < self._eta_s(done, rate)):
            completed, total = min(elapsed, self.runtime_s), self.runtime_s
        else:
            completed, total = done, self.total
        self._progress.update(self._task, completed=completed, total=total, rate=rate_text)

    def _eta_s(self, done: float, rate: float) -> float:
        if self.total is None or rate <= 0:
            return float("inf")
        return (self.total - done) / rate

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=True)
        self._task = self._progress.add_task(self.jobname, total=self.total or self.runtime_s or None, rate="")
        self._progress.start()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
