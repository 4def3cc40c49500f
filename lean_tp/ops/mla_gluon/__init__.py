"""MLA decode for sm_90 written in Gluon (``kernel``), over lean's stream-K schedule, with its
split outputs merged by a Triton kernel (``combine``); ``launcher.mla_decode_gluon`` runs it, on a
schedule ``mla_gluon_schedule`` computes once a step.

``lean_tp.decode_attention`` runs a call here through the op ``lean_tp::mla_decode_gluon`` (``op``)
where the plan routes it (``launcher.gluon_takes``): 16-bit latent caches in 64-row pages, heads
in 64-row blocks, up to 16 query tokens a sequence, and a tuning entry that sets
``DecodeConfig.gluon_rows``: sm_90's 16-bit MLA entry routes 64 rows (Tq x heads) and more,
DP attention's 128 heads (measured on an H200 against the Triton kernel: docs/mla.md) and Kimi-K2's
64 (its iterations measured: tuning.py). The kernel
also reads e4m3 pools (``mla_decode_gluon`` with ``k_scale`` and ``v_scale``; the op passes an
e4m3 call's scales), and the e4m3 entry sets no ``gluon_rows``: its calls stay on the Triton
kernel until a GPU has timed this one against it (benchmarks/mla_decode_gluon.py). So does the
16-bit loop that overlaps a block's score with the P.V before it (``launcher.OVERLAP``): calls
keep the serial loop the H200 measured until the benchmark has timed the two.
"""

from lean_tp.ops.mla_gluon.launcher import mla_decode_gluon, mla_gluon_schedule

__all__ = ["mla_decode_gluon", "mla_gluon_schedule"]
