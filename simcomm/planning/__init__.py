"""Planning: memory per rank and modelled step time, from formulas or from traced runs.

=================  ===========================================================================
``planner``        every 4-D layout of a GPU budget for a Llama: memory by label, the modelled
                   ``step_time`` and its parts; ``fastest_fitting`` of any rows (lesson 15)
``published``      the published Llama 3 runs (Llama 3 paper, torchtitan) with the recipe of each,
                   the calibration of the planner on two of them, the rest to validate
``layout_choice``  memory and modelled step time of every 3-D layout, measured on virtual ranks
                   (lesson 12)
``cluster_step``   a shape-only 3-D training step for the trace and memory at cluster scale
``activations``    activation memory per layer and what recomputation buys (lesson 13)
``fsdp2_step``     one FSDP2 training step of the Llama, run shape-only to size a real model
=================  ===========================================================================
"""
