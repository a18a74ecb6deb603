"""The sections of ``scripts/benchmark.py``, one module each, and what they share.

:mod:`~scripts.benchmarks.workloads` (settings, models, data, the plain optimizer), :mod:`~scripts.benchmarks.timing`
(interleaved rounds), :mod:`~scripts.benchmarks.bayesdll` (BayesDLL's own code in the rounds), the sections
:mod:`~scripts.benchmarks.step`, :mod:`~scripts.benchmarks.curvature`, :mod:`~scripts.benchmarks.epoch`,
:mod:`~scripts.benchmarks.predict`, :mod:`~scripts.benchmarks.laplace` and :mod:`~scripts.benchmarks.lora`, then :mod:`~scripts.benchmarks.targets`
and :mod:`~scripts.benchmarks.report`.
"""
