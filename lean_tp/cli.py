"""What every command-line entry point shares: flags checked before any work, one-line errors, and
progress that suits where it is written.

The habit, for ``examples/``, ``benchmarks/``, ``scripts/`` and ``python -m lean_tp.*`` alike:

    p = cli.ArgumentParser(prog=..., description=...)
    p.add_argument("--batch", type=cli.integer(1), default=4)
    p.add_argument("--out", type=cli.output_dir, default="out/x")
    args = p.parse_args(argv)
    if <a rule across flags fails>:
        p.fail("--prompt-len", "lengths <= the model's max_seq_len 4096", args.prompt_len)

A mistake prints one line, ``PROG: error: argument --batch: expected an integer >= 1, got '0'``,
and exits with status 2; there is no traceback and no usage dump. Under torchrun every rank parses
the same flags, so every rank exits at once with status 2 and only rank 0 prints the line.
Type functions run on string defaults too, and paths are checked when parsed: a missing input
file or an unwritable output fails before minutes of work, not after.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

# Seconds between progress lines when the output is a log, not a terminal.
LOG_INTERVAL_S = 10.0
# Seconds before a bar first shows on a terminal: a shorter wait needs none. A log gets a line at
# the start and the end of every wait, so that it shows what ran and for how long.
PROGRESS_DELAY_S = 2.0


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error habit (see the module docstring)."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") != "0":
            # torchrun stops every rank once one exits: give rank 0 the moment it needs to print.
            time.sleep(1.0)
            sys.exit(2)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def fail(self, flag: str, expected: str, got: object) -> NoReturn:
        """A rule across flags, or one only known after parsing, does not hold for ``flag``."""
        self.error(f"argument {flag}: expected {expected}, got {got!r}")


def _bounds(lo: float | None, hi: float | None, strict_lo: bool = False) -> str:
    show = lambda x: str(x) if isinstance(x, int) else f"{x:g}"  # noqa: E731
    parts = []
    if lo is not None:
        parts.append(f"{'>' if strict_lo else '>='} {show(lo)}")
    if hi is not None:
        parts.append(f"<= {show(hi)}")
    return " and ".join(parts)


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (either bound may be None)."""
    want = " ".join(["an integer", _bounds(lo, hi)]).strip()

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = want  # argparse names the type in some messages
    return parse


def number(lo: float | None = None, hi: float | None = None, strict_lo: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in [lo, hi], or (lo, hi] with ``strict_lo``."""
    want = " ".join(["a number", _bounds(lo, hi, strict_lo)]).strip()

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        low_ok = lo is None or (value > lo if strict_lo else value >= lo)
        if not (math.isfinite(value) and low_ok and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = want
    return parse


def integer_list(lo: int | None = None, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: a comma list of integers, each in [lo, hi]."""
    want = " ".join(["a comma list of integers", _bounds(lo, hi)]).strip()

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if any((lo is not None and v < lo) or (hi is not None and v > hi) for v in values):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return values

    parse.__name__ = want
    return parse


def choice(*names: str) -> Callable[[str], str]:
    """An argparse ``type``: one of ``names`` (argparse's own ``choices`` error reads differently)."""
    want = f"one of {', '.join(names)}"

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return text

    parse.__name__ = want
    return parse


def device(text: str) -> str:
    """An argparse ``type``: a torch device this machine has, ``cpu`` or ``cuda[:N]``."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = f"cpu or cuda[:N] ({count} CUDA device{'s' if count != 1 else ''} here)"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and (dev.index or 0) >= count):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return text


def memory_bytes(dev: str) -> int:
    """Total memory of a device: the GPU's, or the host's for ``cpu``."""
    import torch

    if torch.device(dev).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(dev)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def existing_file(text: str) -> str:
    """An argparse ``type``: a file that exists and can be read."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r}")
    return text


def existing_dir(text: str) -> str:
    """An argparse ``type``: a directory that exists and can be read."""
    if not os.path.isdir(text) or not os.access(text, os.R_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"expected an existing directory, got {text!r}")
    return text


def output_dir(text: str) -> str:
    """An argparse ``type``: a directory to write into, created now if it is missing."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError:
        pass
    if not (os.path.isdir(text) and os.access(text, os.W_OK | os.X_OK)):
        raise argparse.ArgumentTypeError(f"expected a writable directory (created if missing), got {text!r}")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a file to write, in a directory that exists ('-' is stdout). It is opened
    for appending now (created if missing, its contents kept), which is the one test that holds
    for every reason a write can fail, root's exemptions from permissions included."""
    parent = os.path.dirname(os.path.abspath(text))
    if text == "-":
        return text
    try:
        if os.path.isdir(text) or not os.path.isdir(parent):
            raise OSError
        with open(text, "a"):
            pass
    except OSError:
        raise argparse.ArgumentTypeError(
            f"expected a writable file path in an existing directory, got {text!r}"
        ) from None
    return text


class _Lines(io.TextIOBase):
    """A file for tqdm that turns its redrawn status line into one plain line per update."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.last = stream, ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:  # tqdm redraws the final state when it closes
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress(
    iterable: Iterable | None = None,
    *,
    desc: str,
    unit: str = "it",
    total: int | None = None,
    eta: bool = True,
    leave: bool = True,
    disable: bool = False,
    stream: Any = None,
):
    """A tqdm bar on a terminal (after PROGRESS_DELAY_S); in a log, plain lines at the start, every
    LOG_INTERVAL_S seconds and at the end.

    ``eta=False`` where the first steps are not like the rest (a compile, a cold cache), so that a
    remaining-time estimate would mislead.
    """
    from tqdm import tqdm

    stream = stream or sys.stderr
    tty = hasattr(stream, "isatty") and stream.isatty()
    rate = "{rate_fmt}" if eta else ""
    if tty:
        fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}" + ("<{remaining}, " + rate if eta else "") + "]"
    else:
        fmt = "{desc}: {n_fmt}/{total_fmt} " + unit + " [{elapsed}" + ("<{remaining}" if eta else "") + "]"
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=leave if tty else True,
        disable=disable,
        file=stream if tty else _Lines(stream),
        mininterval=0.1 if tty else LOG_INTERVAL_S,
        bar_format=fmt,
        dynamic_ncols=tty,
        delay=PROGRESS_DELAY_S if tty else 0.0,
    )
