"""Helpers shared by every op folder under ``lean_tp/ops/`` (as ``fla/ops/utils`` is for
flash-linear-attention): nothing here knows about one op."""

from __future__ import annotations

import functools
import inspect

import torch

# The floating dtypes the ops compute in (q, out); caches may also be fp8.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require_tensor(name: str, x: object) -> None:
    """``TypeError`` naming the argument unless ``x`` is a tensor (before the dispatcher rejects
    it with a RuntimeError)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` was defined under ``TRITON_INTERPRET=1`` and so runs on CPU tensors.

    The decorator reads the variable when the kernel is defined, so a later change of the
    environment does not change the answer: ask the kernel, not the environment.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"3.7.1"`` or ``"2.13.0+cpu"``."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_interpreter_numpy(triton_version: str, numpy_version: str) -> None:
    """Fail fast on a stack whose Triton interpreter cannot run any of our kernels.

    triton < 3.7's interpreter turns a runtime loop bound (a 1-element array) into an int with
    ``int(array)``, which numpy >= 2.4 rejects deep inside the first launch; triton 3.7 fixed it.
    """
    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        raise ImportError(
            f"TRITON_INTERPRET=1 with triton {triton_version}: expected numpy < 2.4, got numpy {numpy_version}; "
            "install 'numpy<2.4' or triton >= 3.7"
        )


# The interpreter's own language patcher (``triton.runtime.interpreter._patch_lang``), once
# ``interpret_device_calls_once`` has wrapped it; and the language modules the launch running now
# has patched (None between launches).
_patch_lang = None
_launch_langs: set[frozenset[int]] | None = None


class _NothingToRestore:
    def restore(self) -> None:
        pass


def _patch_lang_once(fn):
    """The interpreter's patcher for ``fn``'s language modules, unless the running launch has
    patched those modules already: then a scope with nothing to restore."""
    import triton.language as tl

    langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    if _launch_langs is not None:
        if langs in _launch_langs:
            return _NothingToRestore()
        _launch_langs.add(langs)
    return _patch_lang(fn)


def interpret_device_calls_once() -> None:
    """Have the Triton interpreter map ``triton.language`` onto numpy once a launch, not again at
    every call of a ``@triton.jit`` helper inside it.

    The interpreter (``triton.runtime.interpreter``, the same code in triton 3.6 to 3.9) patches
    the language when a launch starts, restores it when the launch ends, and patches it again at
    every device-function call in between: a scan of the module's members, about 0.7 ms a call,
    that finds it already patched. The kernels call helpers in every iteration, so the repeats
    were more than half of the schedule kernel's time on CPU and about a third of a decode call's.
    After this, a helper whose language modules the running launch has patched skips the repeat;
    a launch patches and restores as before. An interpreter without these internals is left as
    it is. Launches from several threads at once share the patch, as they share the interpreter's.
    """
    global _patch_lang
    from triton.runtime import interpreter

    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if _patch_lang is not None or grid_call is None or not callable(getattr(interpreter, "_patch_lang", None)):
        return
    _patch_lang = interpreter._patch_lang

    @functools.wraps(grid_call)
    def launch(self, *args, **kwargs):
        global _launch_langs
        _launch_langs = set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch_langs = None

    interpreter._patch_lang = _patch_lang_once
    interpreter.GridExecutor.__call__ = launch
