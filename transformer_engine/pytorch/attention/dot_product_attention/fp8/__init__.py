"""FP8 attention (issue 24): what a DotProductAttention call needs beyond its high-precision path.

- :mod:`.context`: the call's :class:`~.context.FP8Context`, read from the FP8 region
  (``transformer_engine.pytorch.quantization.autocast``) and carried by ``AttentionInputs.fp8``;
- :mod:`.state`: the module's scales and amax histories in TE's slot layout, and the
  delayed-scaling update;
- :mod:`.quantize`: fake quantization as autograd Functions at the six FP8 points;
- :mod:`.emulation`: the unfused backend's emulation of the FP8 kernels;
- :mod:`.checkpoint`: the FP8 metadata in TE's extra-state format.
"""
