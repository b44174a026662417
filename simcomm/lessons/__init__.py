"""The lessons' exercise checkers, one module per group of lessons, and their shared verdicts.

================  ==============================================================
``foundations``   lessons 00-05: collectives, autograd, ring all-reduce, TP, Ulysses
``training``      lessons 06-08: data parallelism, ZeRO and FSDP, pipelines
``scaling``       lessons 09-12: context and expert parallelism, debugging, 3-D
``verdicts``      the wording every checker uses: ``Correct``, ``Not yet: ...``
``debugging``     helpers lesson 11 teaches (replication checks, error summaries)
================  ==============================================================
"""
