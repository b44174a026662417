"""The models the lessons train and the planners size: one transformer block family and one Llama.

==================  ===========================================================================
``transformer``     the GPT-style block family: the checked 3-D block (lesson 12), the recompute
                    layer (lesson 13) and the cluster-scale block (lesson 15), one module
``llama``           the Llama: one ``Config`` (the lesson's small one and the Llama 3 shapes), one
                    set of blocks, in a functional form (tensor/sequence/context parallel) and an
                    ``nn.Module`` form (for FSDP2)
``llama_pipeline``  the Llama as a 1F1B pipeline of tensor-parallel stages
``llama_training``  the Llama trained on a pp x dp x cp x tp mesh (FSDP/HSDP) against one device
==================  ===========================================================================

The parallelisms that train them are in :mod:`simcomm.parallel`; the planners that size
them in :mod:`simcomm.planning`.
"""
