"""Programs: the ``comm-codec`` command line, benchmarks, demos, the in-repo TinyLM, pretrained loaders.

Nothing else in the package imports this layer. The modules:

- :mod:`.cli`: ``comm-codec`` itself (parser, errors, signals, ``inspect``), with one
  ``*_cli`` module per command family registering its parser: :mod:`.checkpoint_cli`
  (compress, decompress, verify, ls), :mod:`.profile_cli`, :mod:`.demo_cli`,
  :mod:`.precompile_cli` (``precompile``, alias ``warmup``). These import neither torch
  nor numba until a command runs.
- :mod:`.bench` (``comm-codec bench``) over :mod:`.bench_data`, :mod:`.bench_codecs`,
  :mod:`.bench_bounds`, :mod:`.bench_measure` and :mod:`.bench_report`.
- :mod:`.demo` (DDP) and :mod:`.fsdp_demo` (FSDP2), both configured by
  :mod:`.train_config` and started by :mod:`.procs` (spawned ranks, torchrun, free ports).
- :mod:`.profiling` (offline books and their report), :mod:`.tinylm`, :mod:`.pretrained`.
"""
