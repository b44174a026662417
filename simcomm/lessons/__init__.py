"""The lessons' exercise checkers and helpers: one module per lesson, and what they share.

=======================  ==============================================================
``lesson_00`` ...        one module per lesson: ``import simcomm.lessons.lesson_NN as check``
``lesson_14``            gives its checkers (``check.check_...``) and assertion helpers
``asserts``              the assertion helpers of every lesson (``assert_close``, ...)
``verdicts``             the wording every checker uses (``Correct``, ``Not yet: ...``), and
                         a learner's distributed function judged as real processes run it
``foundations``          lessons 00-05's checkers (collectives, autograd, ring, TP, Ulysses)
``training``             lessons 06-08's checkers (data parallelism, ZeRO and FSDP, pipelines)
``scaling``              lessons 09-12's checkers (context and expert parallelism, debugging, 3-D)
``memory_and_planning``  lesson 15's checkers (planning a cluster)
``debugging``            helpers lesson 11 teaches (replication checks, error summaries)
=======================  ==============================================================
"""
