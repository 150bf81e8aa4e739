"""Status lines and progress bars of the command line, on stderr (``--quiet`` silences them).

On a terminal they are rich's live status spinner and progress bar (whatever stdout is: piping
the output to a file keeps them on the terminal). When stderr is not a terminal (a log file, a
pipe, a test), each status and each progress step that is at least ``interval`` seconds after
the previous one prints one plain line ``jaxlp: ...``, flushed at once, so a log shows what a
long compilation is doing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import Callable, Iterator


class Interrupts:
    """Ctrl-C for the command line: never lost, never a traceback.

    Python raises ``KeyboardInterrupt`` wherever the main thread is when the signal is handled;
    inside a ``__del__`` or a weakref callback (JAX runs many, e.g. while freeing device
    buffers) the exception is swallowed and printed as "Exception ignored in ...", and the
    program goes on as if nothing happened. :meth:`install` makes SIGINT also set ``pending``
    and drops those swallowed reports; :meth:`check` (called by every :class:`Reporter`
    status, bar step and note, and by the command line before it writes an output) raises
    ``KeyboardInterrupt`` again while one is pending.
    """

    pending = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, frame):
            cls.pending = True
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        previous = sys.unraisablehook

        def hook(unraisable):
            if isinstance(unraisable.exc_value, KeyboardInterrupt):
                return  # raised again at the next check
            previous(unraisable)

        sys.unraisablehook = hook

    @classmethod
    def check(cls) -> None:
        if cls.pending:
            raise KeyboardInterrupt


class Reporter:
    """``status(text)`` and ``bar(text, total)`` context managers, ``note(text)``, and
    ``callback()`` for library functions that take ``progress(what, done, total)``."""

    def __init__(self, quiet: bool = False, *, interval: float = 2.0, stream=None):
        self.quiet = quiet
        self.interval = interval
        self.stream = stream
        self._console = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream or sys.stderr, highlight=False)
        return self._console

    @property
    def live(self) -> bool:
        return not self.quiet and self.console.is_terminal

    def note(self, text: str) -> None:
        """One line on stderr (unless quiet)."""
        Interrupts.check()
        if self.quiet:
            return
        if self.live:
            self.console.print(f"[dim]{text}[/dim]")
        else:
            self._line(text)

    def _line(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(f"jaxlp: {text}", file=stream, flush=True)

    def _progress(self, *columns):
        """A transient rich Progress on stderr. stdout is routed around the live display only
        when it is the terminal too: printed results must stay on a piped stdout."""
        from rich.progress import Progress

        return Progress(*columns, console=self.console, transient=True, redirect_stdout=sys.stdout.isatty(),
                        redirect_stderr=False)

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        """A spinner with ``text`` while the block runs (one line when not on a terminal)."""
        Interrupts.check()
        if self.quiet:
            yield
        elif self.live:
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            with self._progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as progress:
                progress.add_task(text, total=None)
                yield
        else:
            self._line(f"{text} ...")
            yield

    @contextlib.contextmanager
    def bar(self, text: str, total: int) -> Iterator[Callable[..., None]]:
        """A progress bar over ``total`` items; yields ``advance(n=1, description=None)``."""
        Interrupts.check()
        if self.quiet:
            yield lambda n=1, description=None: Interrupts.check()
            return
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn

            with self._progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn()) as progress:
                task = progress.add_task(text, total=total)

                def advance(n: int = 1, description: str | None = None) -> None:
                    Interrupts.check()
                    progress.update(task, advance=n, **({"description": description} if description else {}))

                yield advance
            return
        state = {"done": 0, "last": time.monotonic(), "text": text}
        self._line(f"{text}: 0/{total}")

        def advance(n: int = 1, description: str | None = None) -> None:
            Interrupts.check()
            state["done"] += n
            if description:
                state["text"] = description
            now = time.monotonic()
            if state["done"] >= total or now - state["last"] >= self.interval:
                state["last"] = now
                self._line(f"{state['text']}: {state['done']}/{total}")

        yield advance

    def callback(self, labels: dict[str, str] | None = None) -> Callable[[str, int, int], None]:
        """A ``progress(what, done, total)`` function (as :func:`jaxlp.quantize_model` takes)
        driving one bar per ``what``; call :meth:`close` (or use :meth:`bars`) when done."""
        labels = labels or {}
        open_bars: dict[str, tuple] = {}

        def progress(what: str, done: int, total: int) -> None:
            Interrupts.check()
            if what not in open_bars:
                for other in list(open_bars):
                    self._close_bar(open_bars.pop(other))
                cm = self.bar(labels.get(what, what), total)
                open_bars[what] = (cm, cm.__enter__(), [0])
            _, advance, seen = open_bars[what]
            advance(done - seen[0])
            seen[0] = done
            if done >= total:
                self._close_bar(open_bars.pop(what))

        progress.close = lambda: [self._close_bar(open_bars.pop(k)) for k in list(open_bars)]  # type: ignore[attr-defined]
        return progress

    @staticmethod
    def _close_bar(entry) -> None:
        entry[0].__exit__(None, None, None)
