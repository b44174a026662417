"""The lessons' exercise checkers, one module per group of lessons, and their shared verdicts.

=======================  ==============================================================
``foundations``          lessons 00-05: collectives, autograd, ring all-reduce, TP, Ulysses
``training``             lessons 06-08: data parallelism, ZeRO and FSDP, pipelines
``scaling``              lessons 09-12: context and expert parallelism, debugging, 3-D
``memory_and_planning``  lessons 13 and 15: activations and recomputation, mixed precision,
                         planning a cluster
``llama_4d``             lesson 14: a small Llama on a 4-D mesh (gradient norm, bytes held)
``verdicts``             the wording every checker uses: ``Correct``, ``Not yet: ...``
``debugging``            helpers lesson 11 teaches (replication checks, error summaries)
=======================  ==============================================================
"""
