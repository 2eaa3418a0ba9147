"""Integrations of qwz's bounded, quantized weight gather into other training stacks.

``qwz.integrations.deepspeed`` makes ``zero_quantized_weights`` real in DeepSpeed's own
ZeRO-1/2 optimizer; importing this package imports no third-party framework.
"""
