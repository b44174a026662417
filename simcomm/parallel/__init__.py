"""The parallelisms the lessons teach, each built from the communicator beside its single-device reference.

=================  ===========================================================
``tensor``         Megatron's column/row-parallel MLP
``sequence``       Ulysses attention (all-to-all from sequence to head shards)
``ring``           the ring schedule and exchange (ring all-reduce, all-gather)
``data``           data parallelism: gradient averaging, accumulation, buckets
``zero``           ZeRO stages 1-3 with Adam
``fsdp``           fully sharded data parallel with prefetching
``pipeline``       pipeline schedules (naive, GPipe, 1F1B, interleaved) and bubbles
``context``        ring attention and causal load balancing
``expert``         top-k mixture of experts over ranks
``mesh``           the one Layout: named sizes, rank order, groups per dim
``transformer3d``  one transformer block in TP + SP x DP x PP
``layout_choice``  memory and modelled step time of every 3-D layout
``cluster_step``   a shape-only 3-D step for planning at scale
=================  ===========================================================
"""
