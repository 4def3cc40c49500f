"""Readers of a compiled kernel's cubin, SASS, PTX and TTGIR: resources, the K/V loop, the merge
loop, page-id loads, load widths and pipeline buffers. ``cuobjdump`` comes with Triton."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def dump(cubin: bytes, flag: str) -> str:
    """``cuobjdump FLAG`` of a cubin held in memory."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, static shared bytes) of the cubin's one kernel."""
    text = dump(cubin, "--dump-resource-usage")
    regs, stack, shared = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text).groups()
    return int(regs), int(stack), int(shared)


def _sass_loops(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """(address, opcode) of every instruction, and the innermost loops (backward branches with no
    other loop inside) as (first, last) addresses, of ``cuobjdump -sass`` output."""
    code = [
        (int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    ]
    loops = [
        (int(target, 16), int(addr, 16))
        for addr, target in re.findall(r"/\*([0-9a-f]+)\*/[^;]*?\bBRA\b[^;]*?0x([0-9a-f]+)\s*;", text)
        if int(target, 16) < int(addr, 16)
    ]
    return code, [(lo, hi) for lo, hi in loops if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]


def _count(code: list[tuple[int, str]], loop: tuple[int, int], matches) -> int:
    """Instructions of ``loop`` whose opcode ``matches``."""
    return sum(matches(op) for a, op in code if loop[0] <= a <= loop[1])


def _tensor_core(op: str) -> bool:
    """A tensor-core multiply-accumulate (HMMA, or HGMMA: sm_90's wgmma)."""
    return op.split(".")[0] in ("HMMA", "HGMMA")


def _loop_counts(code: list[tuple[int, str]], loop: tuple[int, int]) -> tuple[int, int]:
    """(instructions, LDL/STL) of ``loop``."""
    body = [op.split(".")[0] for a, op in code if loop[0] <= a <= loop[1]]
    return len(body), sum(op in ("LDL", "STL") for op in body)


def _kv_loop(code: list[tuple[int, str]], innermost: list[tuple[int, int]]) -> tuple[int, int]:
    """(first, last) address of the K/V loop among ``_sass_loops``'s innermost loops: the one
    holding the most tensor-core multiply-accumulates (HMMA/HGMMA), or the most FFMA when no loop
    has any (fp32's "ieee" dots). The merge's loop has FFMA but no HMMA."""
    macs = (
        _tensor_core
        if any(_count(code, loop, _tensor_core) for loop in innermost)
        else (lambda op: op.split(".")[0] == "FFMA")
    )
    return max(innermost, key=lambda loop: _count(code, loop, macs), default=(0, -1))


def _kv_loop_instructions(text: str) -> list[tuple[str, str]]:
    """(opcode, operands) of each instruction of the K/V loop (``_kv_loop``), in order."""
    lo, hi = _kv_loop(*_sass_loops(text))
    return [
        (op, operands)
        for a, op, operands in re.findall(
            r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", text
        )
        if lo <= int(a, 16) <= hi
    ]


def kv_loop_of_sass(text: str) -> tuple[int, int]:
    """(instructions, LDL/STL) of the K/V loop (``_kv_loop``) in ``cuobjdump -sass`` output."""
    code, innermost = _sass_loops(text)
    return _loop_counts(code, _kv_loop(code, innermost))


def mma_loops_of_sass(text: str) -> list[tuple[int, int]]:
    """(instructions, LDL/STL) of every innermost loop with tensor-core multiply-accumulates, in
    address order: a warp-specialized kernel's partitions each have their own K/V loop."""
    code, innermost = _sass_loops(text)
    return [_loop_counts(code, loop) for loop in sorted(set(innermost)) if _count(code, loop, _tensor_core)]


def kv_loop_fp8_conversions(text: str) -> int:
    """The K/V loop's fp8 conversions on the conversion unit (``F2F``, and ``F2FP`` from e4m3 or
    e5m2) in ``cuobjdump -sass`` output, a thread's an iteration: Triton's e4m3 to bf16 takes 1.5 a
    value; ``attend.e4m3_to_bf16`` none."""
    code, innermost = _sass_loops(text)
    lo, hi = _kv_loop(code, innermost)
    fp8 = re.compile(r"F2F\.\S+|F2FP\.\S*E[45]M[32]\S*")
    return sum(bool(fp8.fullmatch(op)) for a, op in code if lo <= a <= hi)


def kv_copy_bytes(text: str) -> int:
    """Bytes one thread copies from global memory in an iteration of the K/V loop: the 8- and
    16-byte ``LDGSTS`` (``.64``, ``.128``: cp.async into shared memory) and ``LDG`` (``.64``,
    ``.128``) of its body; 4-byte ones are page ids. Times the program's threads over BLOCK_N, the
    bytes the loop reads per key (``KernelStats.bytes_per_key``)."""
    code, innermost = _sass_loops(text)
    lo, hi = _kv_loop(code, innermost)
    widths = [
        int(m.group(2)) // 8
        for a, op in code
        if lo <= a <= hi and (m := re.fullmatch(r"(LDGSTS|LDG)\.E\S*?\.(64|128)(\.\w+)*", op))
    ]
    return sum(widths)


def _smem_read_bytes(op: str, operands: str) -> tuple[int, int]:
    """(bytes a warp's instruction reads from shared memory, bytes a warp group's) for one SASS
    instruction: ``LDSM`` 8 x 8 16-bit matrices (128 bytes each, 1, 2 or 4 of them), ``LDS`` its
    width x 32 lanes, and ``HGMMA``'s operands given by a descriptor (``gdesc``: B's N x K always,
    A's 64 x K unless A is in registers), 16-bit (``.BF16``, or no suffix: fp16) or 8-bit
    (``.E4M3``/``.E5M2``)."""
    if m := re.fullmatch(r"LDSM\.16\.MT?88(?:\.(\d))?", op):
        return 128 * int(m.group(1) or 1), 0
    if m := re.fullmatch(r"LDS(?:\.(U8|S8|U16|S16|64|128))?", op):
        width = {None: 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}[m.group(1)]
        return 32 * width, 0
    if m := re.match(r"HGMMA\.64\s*x(\d+)x(\d+)\.F32(?:\.(\w+))?\s*(.*)", op + operands):
        n, k, elem = int(m.group(1)), int(m.group(2)), 1 if m.group(3) in ("E4M3", "E5M2") else 2
        a_in_smem = m.group(4).split(",")[1].strip().startswith("gdesc")
        return 0, (64 * k * a_in_smem + n * k) * elem
    return 0, 0


def kv_smem_read_bytes(text: str, num_warps: int) -> int:
    """Shared-memory bytes one iteration of a program's K/V loop reads (``_smem_read_bytes`` of
    its body, over its warps and warp groups): a tile several warps read is counted once a warp,
    as the hardware reads it. The K/V tile's copy in (cp.async) is not counted."""
    warp = group = 0
    for op, operands in _kv_loop_instructions(text):
        w, g = _smem_read_bytes(op, operands)
        warp, group = warp + w, group + g
    return warp * num_warps + group * (num_warps // 4)


def _registers(operands: str) -> set[int]:
    """General registers an operand list names (``R7``, a pair ``R6.64``; not ``UR``/``RZ``)."""
    regs = set()
    for n, pair in re.findall(r"(?<![A-Z])R(\d+)(\.64)?", operands):
        regs |= {int(n), int(n) + 1} if pair else {int(n)}
    return regs


def page_id_timing(text: str) -> tuple[int, int]:
    """(block-table loads, of them read in the iteration that issues them) in the K/V loop.

    A block-table load is a 32-bit ``LDG.E`` into a register, or a 4-byte ``LDGSTS.E`` into shared
    memory: the pipeliner's copy a stage ahead (``DecodeConfig.paged_stages``), read after a wait
    on a later pass (K/V data arrive by 16-byte ``LDGSTS`` or wider loads, the merge's partials by
    ``.STRONG.GPU`` loads, outside the loop). A register load is read in its own iteration when a
    later instruction of the loop body reads its register before any writes it; otherwise the
    value is carried to the next iteration, which is what hides its latency.
    """
    body = _kv_loop_instructions(text)
    loads = same = 0
    for i, (op, rest) in enumerate(body):
        loads += op == "LDGSTS.E"
        if not re.fullmatch(r"LDG\.E(\.CONSTANT)?", op):
            continue
        loads += 1
        reg = min(_registers(rest.split(",")[0]))
        for later_op, later in body[i + 1 :]:
            first, _, sources = later.partition(",")
            # A first operand that is a bare register is written (a pair by .WIDE); any other
            # (an address, a predicate) is read.
            writes = _registers(first) if re.fullmatch(r"\s*R\d+\S*\s*", first) else set()
            if "WIDE" in later_op and writes:
                writes |= {min(writes) + 1}
            if reg in _registers(sources) | (_registers(first) - writes):
                same += 1
                break
            if reg in writes:
                break
    return loads, same


def merge_loop_of_sass(text: str) -> tuple[int, int]:
    """(instructions, partial loads) of one iteration of the merge's loop: the innermost loop with
    the most L2-coherent loads (``ld.global.cg``, ``LDG.E*.STRONG.GPU`` in SASS), one wave of
    partials per iteration; (0, 0) when there is none."""
    code, innermost = _sass_loops(text)
    coherent = lambda op: op.startswith("LDG") and op.endswith("STRONG.GPU")  # noqa: E731
    best = max(innermost, key=lambda loop: _count(code, loop, coherent), default=None)
    if best is None or not _count(code, best, coherent):
        return 0, 0
    return _count(code, best, lambda op: True), _count(code, best, coherent)


def kv_load_bytes(ptx: str) -> tuple[int, int]:
    """(K, V) global load widths in bytes (``KernelStats.k_load_bytes``)."""
    copy = r"cp\.async\.c[ag]\.shared\.global[^;]*?, (0x[0-9a-f]+)"
    groups = [[int(w, 16) for w in re.findall(copy, g)] for g in ptx.split("cp.async.commit_group")]
    # Page ids copied a stage ahead (paged_stages) are 4-byte copies of their own, or joined to a
    # K/V group: K/V tiles are copied 8 or 16 bytes at a time.
    groups = [wide for g in groups if (wide := [w for w in g if w > 4])]
    if groups:
        k, v = (collections.Counter(w for g in groups[i::2] for w in g) for i in (0, 1))
        return k.most_common(1)[0][0], (v or k).most_common(1)[0][0]
    # No async copies: data loads into registers (.cg loads are the merge's partials).
    widths = [
        int(vec or 1) * int(bits) // 8 for vec, bits in re.findall(r"ld\.global(?:\.L1::\w+)?(?:\.v(\d))?\.b(\d+)", ptx)
    ]
    width = collections.Counter(widths).most_common(1)[0][0] if widths else 0
    return width, width


def kv_buffers(ttgir: str, block_n: int) -> int:
    """K/V tiles per operand that the pipeliner allocates ((buffers, BLOCK_N, columns) shared
    allocations: BLOCK_D columns, a quarter of them for fp8 read as int32 words), 1 when it
    allocates none (the tile is staged once, in the loop)."""
    shapes = re.findall(rf"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x{block_n}x\d+x", ttgir)
    return max((int(n) for n in shapes), default=1)
