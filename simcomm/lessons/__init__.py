"""The lessons' exercise checkers and helpers: one module per lesson, and what they share.

=======================  ==============================================================
``lesson_00`` ...        one module per lesson, where its checkers are written:
``lesson_14``            ``import simcomm.lessons.lesson_NN as check`` gives them
                         (``check.check_...``) and the assertion helpers
``asserts``              the assertion helpers of every lesson (``assert_close``, ...)
``verdicts``             the wording every checker uses (``Correct``, ``Not yet: ...``), the
                         reading of answers several lessons share, and a learner's distributed
                         function judged as real processes run it
``foundations``          lessons 00-05's checkers under one name (written in ``lesson_00``-``05``)
``training``             lessons 06-08's checkers under one name (written in ``lesson_06``-``08``)
``scaling``              lessons 09-12's checkers under one name (written in ``lesson_09``-``12``)
``memory_and_planning``  lesson 15's checkers (planning a cluster)
``debugging``            helpers lesson 11 teaches (replication checks, error summaries)
=======================  ==============================================================
"""
