"""Checkpoints as published: Hugging Face DeepSeek attention weights (``hf``), checkpoint folders read one layer at
a time (``checkpoint``) and block-quantised fp8 weights (``fp8``). Building layers from them is the layer's
(``mla_backends.layer.pretrained``).

Imports: ``core`` only.
"""
