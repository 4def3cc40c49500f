"""What importing lean_tp does to Triton's interpreter under ``TRITON_INTERPRET=1``: a check that
this stack's interpreter can run our kernels at all, and ``speed_up_interpreter``, which skips
work the interpreter repeats or discards and changes no result.

The interpreter runs a kernel's Python body once a program, and every ``tl`` operation in it goes
through Triton's front end (type checks, broadcasting, casts) before numpy does the arithmetic.
On the small blocks of the CPU tests that front end is the cost, so what it repeats is worth
skipping. Each change below reaches into ``triton.runtime.interpreter``, the same code in triton
3.6 to 3.9; an interpreter without the internal a change needs is left as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from lean_tp.ops.utils import major_minor


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


def speed_up_interpreter() -> None:
    """The three changes, once a process: the language mapped once a launch
    (``interpret_device_calls_once``), numpy dtypes looked up once a Triton dtype
    (``_memoize_np_dtype``), and no integer overflow checks whose result is discarded
    (``_skip_discarded_overflow_checks``). A decode call then takes about a third of the CPU of
    the interpreter as it comes (README)."""
    from triton.runtime import interpreter

    interpret_device_calls_once()
    _memoize_np_dtype(interpreter)
    _skip_discarded_overflow_checks(interpreter)


# The interpreter's own language patcher (``triton.runtime.interpreter._patch_lang``), once
# ``interpret_device_calls_once`` has wrapped it; the language modules the launch running now has
# patched (None between launches); and each function's language modules, by function.
_patch_lang = None
_launch_langs: set[frozenset[int]] | None = None
_fn_langs: dict[object, frozenset[int]] = {}


class _NothingToRestore:
    def restore(self) -> None:
        pass


def _patch_lang_once(fn):
    """The interpreter's patcher for ``fn``'s language modules, unless the running launch has
    patched those modules already: then a scope with nothing to restore."""
    langs = _fn_langs.get(fn)
    if langs is None:  # a scan of the function's globals, once a function
        import triton.language as tl

        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        _fn_langs[fn] = langs
    if _launch_langs is not None:
        if langs in _launch_langs:
            return _NothingToRestore()
        _launch_langs.add(langs)
    return _patch_lang(fn)


def interpret_device_calls_once() -> None:
    """Have the Triton interpreter map ``triton.language`` onto numpy once a launch, not again at
    every call of a ``@triton.jit`` helper inside it.

    The interpreter patches the language when a launch starts, restores it when the launch ends,
    and patches it again at every device-function call in between: a scan of the module's
    members, about 0.7 ms a call, that finds it already patched. The kernels call helpers in every
    iteration, so the repeats were more than half of the schedule kernel's time on CPU and about a
    third of a decode call's. After this, a helper whose language modules the running launch has
    patched skips the repeat; a launch patches and restores as before. Launches from several
    threads at once share the patch, as they share the interpreter's.
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


def _memoize_np_dtype(interpreter) -> None:
    """``_get_np_dtype`` (the numpy dtype that holds a Triton dtype's values) builds its table of
    18 dtypes at every call, and every cast, constant and binary operation calls it: a tenth of a
    decode call's CPU. A block type's answer is its element type's (the function says so), so the
    cache is keyed by element type; a type that cannot be a key (a pointer type) asks the function."""
    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None or getattr(get, "memoized", False):
        return
    import triton.language as tl

    found: dict[object, object] = {}

    @functools.wraps(get)
    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return found[key]
        except KeyError:
            found[key] = get(key)
            return found[key]
        except TypeError:  # unhashable
            return get(key)

    np_dtype.memoized = True
    interpreter._get_np_dtype = np_dtype


def _skip_discarded_overflow_checks(interpreter) -> None:
    """Integer add, sub and mul each compute an overflow check (both operands cast to int64, the
    operation again, two comparisons, an and) for ``device_assert``, which drops it unless the
    builder's ``debug`` option is set, and the interpreter's builder never sets it: a tenth of a
    decode call's CPU for a condition nobody reads. With ``debug`` set, the checks stay."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return
    if getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
