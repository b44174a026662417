"""The one compiled part of simcomm: the scheduler's hand-off (simcomm/sim/_handoff.c).

It is optional: where it cannot be built (no C compiler, no POSIX semaphores), the
install goes on and the scheduler hands turns on with Python locks, as before.
Everything else is in pyproject.toml.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("simcomm.sim._handoff", ["simcomm/sim/_handoff.c"], optional=True)])
