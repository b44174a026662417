"""What the hardware would do: the alpha-beta cost model, cited topology presets, the modelled timeline.

``topology.py`` holds the presets as data (with the published figures they
were set from), ``cost.py`` the model of each collective's algorithms and
protocols (time, algbw, busbw as nccl-tests reports them), and ``overlap.py``
the modelled timeline that lays a trace's calls and declared compute out per
rank.
"""
