"""What the harness watches on every rank and every step, one file per thing observed.

Everything here reads an engine through [Note: own shards] (qwz/shards.py) --
``own_shards()`` and ``shard_optimizer`` -- and the model's parameters, never an engine's
internals, so the same observers serve qwz's engine and the DeepSpeed drop-in (stock
DeepSpeed included, for the reference arm); only ``engine_report`` reads what an engine says
about itself.

- ``own_shard``: every rank's own shard against the contract ([Note: own shard against the spec]);
- ``update``: the AdamW step re-derived, and the norm it was handed ([Note: exact update check],
  [Note: global norm check]);
- ``digest``: layout-independent digests of masters and replicas;
- ``overflow``: fp16 overflows, from the harness's own tensors;
- ``engine_report``: the kernels the engine ran, non-finite parameters;
- ``piecewise``: what they share (bounded pieces, the all-reduce).
"""
