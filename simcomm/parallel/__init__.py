"""The parallelisms the lessons teach, each built from the communicator beside its single-device reference.

===================  ===========================================================
``tensor``           Megatron's column/row-parallel MLP
``sequence``         Ulysses attention (all-to-all from sequence to head shards)
``ring``             the ring schedule and exchange (ring all-reduce, all-gather)
``data``             data parallelism: gradient averaging, accumulation, buckets
``zero``             ZeRO stages 1-3 with Adam
``fsdp``             fully sharded data parallel with prefetching
``pipeline``         pipeline schedules (naive, GPipe, 1F1B, interleaved) and bubbles
``context``          ring attention and causal load balancing
``expert``           top-k mixture of experts over ranks
``mesh``             the one Layout: named sizes, rank order, groups per dim
``vocab``            vocabulary-parallel embedding and cross-entropy
``mixed_precision``  bf16 parameters with fp32 master weights and Adam; bytes by label
``llama_fsdp``       FSDP (ZeRO-3) flat pieces of tensor-parallel shards, one all-gather per stage
===================  ===========================================================

The models they train are in :mod:`simcomm.models`, the planners in :mod:`simcomm.planning`.
"""
