"""Progress of the long foreground commands (`omrl eval`, `collect`, `sft`, `demo`, `bench`): a
bar with the rate and the time left on a terminal (tqdm, to stderr), a log line at every tenth
elsewhere (logs, CI), nothing with `omrl --quiet` (OMRL_QUIET=1, which child processes inherit).

    with Progress(len(tasks), "episodes", "evaluating letters") as bar:
        ...
        bar.update()
"""

from __future__ import annotations

import os
import sys
import time

QUIET_ENV = "OMRL_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


class Progress:
    def __init__(self, total: int, unit: str, what: str):
        self.total, self.unit, self.what = total, unit, what
        self.done, self.started, self.next_line = 0, time.monotonic(), 1
        self.bar = None
        if quiet() or total <= 0:
            self.mode = "none"
        elif sys.stderr.isatty():
            from tqdm import tqdm

            self.mode, self.bar = "bar", tqdm(total=total, unit=f" {unit}", desc=what, dynamic_ncols=True, leave=True)
        else:
            self.mode = "lines"

    def update(self, n: int = 1, note: str = "") -> None:
        """`n` more done; `note` (a loss, say) goes beside the count."""
        self.done += n
        if self.mode == "bar":
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
        elif self.mode == "lines" and (10 * self.done >= self.next_line * self.total or self.done >= self.total):
            self.next_line = 10 * self.done // self.total + 1
            print(f"{self.what}: {self.line()}" + (f", {note}" if note else ""), file=sys.stderr, flush=True)

    def line(self) -> str:
        """`37/64 episodes (58%), 12.3 s, about 8.9 s left`."""
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        return (f"{self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%), {elapsed:.1f} s"
                + (f", about {left:.0f} s left" if self.done < self.total else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
