"""Tools around the ops, not on the decode path: the kernel report (what the kernel compiles to
for sm_80 and sm_90, read on CPU) and the decode simulator (schedules and merges in modelled
time), with the hardware constants they share (``gpus.py``) and a process pool (``processes.py``)."""
