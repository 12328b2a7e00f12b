"""The ``kvoff`` command's tooling, apart from the library: the command line (:mod:`.cli`, with
:mod:`._cli_args`), the benchmarks (:mod:`.bench`, :mod:`.bench_interference`,
:mod:`.bench_remote`, :mod:`.bench_serve`), the demo (:mod:`.demo`), the pure-Python reference
managers the benchmarks measure against (:mod:`._pyref`) and their small shared helpers
(:mod:`._progress`, :mod:`._toolbase`). The library (``kvoff`` and ``kvoff.vllm``,
``kvoff.sglang``) never imports this package; within it no module imports one that imports it
back (``scripts/import_cycles.py``)."""
