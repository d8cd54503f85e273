"""What rank 0 shows on the console while a run trains: a live bar or plain lines.

``logger.progress`` picks it, from the one table :data:`MODES`: ``bar`` (a ``tqdm`` bar: env
steps / total, steps/s, ETA, the last-100 return and the exposed ms per iteration), ``lines``
(one plain line per log interval, for CI and log files), ``auto`` (``bar`` when the console is a
terminal, ``lines`` otherwise). :func:`choose` decides once, when rank 0 builds its logger;
:class:`ConsoleLogger` is the logger sink that drives the display. Other ranks show nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Protocol

from conduit_dist.errors import ConfigError
from conduit_dist.extras import require

log = logging.getLogger("conduit_dist")

MODES = ("auto", "bar", "lines")
"""Allowed values of ``logger.progress``."""

# (metric, label, format) the lines show, in this order; the bar shows those in _BAR
_SHOWN = (
    ("rl/episode_return_100", "ret100", "{:.1f}"),
    ("rate/env_steps_per_s", "env/s", "{:,.0f}"),
    ("path/iter_exposed_ms", "exposed_ms/it", "{:.2f}"),
    ("path/wait_ms_mean", "wait_ms", "{:.2f}"),
    ("path/total_ms_mean", "round_ms", "{:.2f}"),
    ("train/loss", "loss", "{:.3f}"),
)


class Progress(Protocol):
    """A console display of the run's progress."""

    def update(self, metrics: dict[str, float], step: int) -> None:
        """Show ``metrics`` at env step ``step``."""

    def close(self) -> None:
        """Leave the console clean."""


def check(mode: str) -> None:
    """Raise unless ``mode`` is one of :data:`MODES`.

    Raises:
        ConfigError: naming ``logger.progress``, the allowed values and ``mode``.
    """
    if mode not in MODES:
        raise ConfigError(f"logger.progress: expected one of {list(MODES)}, got {mode!r}")


def choose(mode: str, stream: IO[str] | None = None) -> str:
    """The display for ``mode``: ``bar`` or ``lines`` (``auto``: ``bar`` on a terminal).

    Args:
        mode: a value of :data:`MODES`.
        stream: where the bar would draw (default ``sys.stderr``, where ``tqdm`` writes).

    Returns:
        ``"bar"`` or ``"lines"``.

    Raises:
        ConfigError: on a mode not in :data:`MODES`.

    Example::

        choose("auto", io.StringIO())  # "lines": not a terminal
    """
    check(mode)
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


_BAR = ("ret100", "exposed_ms/it", "loss")  # the bar shows its own rate and ETA


def _shown(metrics: dict[str, float], labels: tuple[str, ...] | None = None):
    return [
        (label, fmt.format(metrics[k]))
        for k, label, fmt in _SHOWN
        if k in metrics and (labels is None or label in labels)
    ]


class Lines:
    """One plain line per log interval through the ``conduit_dist`` logger.

    Args:
        total_steps: env steps of the whole run (for the text bar and the percentage).
    """

    def __init__(self, total_steps: int) -> None:
        self.total = max(total_steps, 1)

    def update(self, metrics: dict[str, float], step: int) -> None:
        """Log one line: a text bar, the percentage, the env steps and the key metrics."""
        frac = min(step / self.total, 1.0)
        bar = "#" * int(frac * 20) + "-" * (20 - int(frac * 20))
        parts = " ".join(f"{label}={v}" for label, v in _shown(metrics))
        log.info("[%s] %3.0f%% steps=%d %s", bar, frac * 100, step, parts)

    def close(self) -> None:
        """Nothing to release."""


class Bar:
    """A live ``tqdm`` bar over env steps (rate, elapsed and ETA from ``tqdm``).

    Args:
        total_steps: env steps of the whole run.
        stream: where it draws (default ``sys.stderr``).
    """

    def __init__(self, total_steps: int, stream: IO[str] | None = None) -> None:
        with require("train", "the progress bar (logger.progress=bar)"):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

        # console log lines (the root logger's) print above the bar instead of through it
        self._redirect = logging_redirect_tqdm([logging.getLogger()])
        self._redirect.__enter__()
        self.bar = tqdm(
            total=max(total_steps, 1),
            unit="step",
            unit_scale=True,
            dynamic_ncols=True,
            smoothing=0.3,
            file=sys.stderr if stream is None else stream,
            desc="env steps",
        )

    def update(self, metrics: dict[str, float], step: int) -> None:
        """Move the bar to ``step`` and show the key metrics after it."""
        shown = ", ".join(f"{k}={v}" for k, v in _shown(metrics, _BAR))
        self.bar.set_postfix_str(shown, refresh=False)
        self.bar.update(max(min(step, self.bar.total) - self.bar.n, 0))
        self.bar.refresh()

    def close(self) -> None:
        """Close the bar (its last state stays on screen) and give the log lines back."""
        self.bar.close()
        self._redirect.__exit__(None, None, None)


def make_progress(mode: str, total_steps: int, stream: IO[str] | None = None) -> Progress:
    """The display :func:`choose` picks for ``mode`` (call it once, on rank 0).

    Raises:
        ConfigError: on a mode not in :data:`MODES`.
    """
    if choose(mode, stream) == "bar":
        return Bar(total_steps, stream)
    return Lines(total_steps)


class ConsoleLogger:
    """Shows the run's progress on the console (``logger.progress``: bar or lines).

    Args:
        total_steps: env steps of the whole run.
        progress: ``auto``, ``bar`` or ``lines`` (``progress.MODES``).
    """

    def __init__(self, total_steps: int, progress: str = "lines") -> None:
        self.display: Progress = make_progress(progress, total_steps)

    def log(self, metrics: dict[str, float], step: int, histograms: object = None) -> None:
        """Update the display."""
        self.display.update(metrics, step)

    def close(self) -> None:
        """Close the display."""
        self.display.close()
