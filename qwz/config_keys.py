"""The DeepSpeed config keys qwz knows: what it reads, what has no effect, what it refuses.

Data only; the rules that apply them are in :mod:`qwz.config`, which re-exports the key
names. Each known key is in one table, so an unknown key (an error suggesting the closest
known one) is told apart from a known one that qwz does not implement (an error that says
so).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

GROUP_SIZE_KEY = "zero_quantized_weights_group_size"
PRESERVE_KEY = "zero_quantized_weights_preserve_numel"
QUANTIZED_WEIGHTS_KEY = "zero_quantized_weights"

# `zero_optimization` keys qwz implements.
ZERO_IMPLEMENTED = (
    "stage",
    QUANTIZED_WEIGHTS_KEY,
    GROUP_SIZE_KEY,
    PRESERVE_KEY,
    "allgather_bucket_size",
    "reduce_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
)

# DeepSpeed keys whose stock default is exactly what qwz does; any other value
# would change behaviour qwz does not implement.
ZERO_DEFAULT_ONLY: Mapping[str, Any] = MappingProxyType(
    {
        "allgather_partitions": True,
        "reduce_scatter": True,
        "round_robin_gradients": False,
        "load_from_fp32_weights": True,
        "ignore_unused_parameters": True,
        "elastic_checkpoint": False,
    }
)

# DeepSpeed features qwz does not implement. `offload_*` may be present when
# switched off (device "none"), as generated configs often have them.
ZERO_UNSUPPORTED = (
    "offload_optimizer",
    "offload_param",
    "zenflow",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "sub_group_size",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "legacy_stage1",
    "use_multi_rank_bucket_allreduce",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
)

# Stage-3 tuning keys: DeepSpeed itself ignores them at stages 1 and 2, and qwz
# never runs stage 3, so they are accepted and have no effect, as in DeepSpeed.
ZERO_STAGE3_TUNING = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "gather_16bit_weights_on_model_save",
    "log_trace_cache_warnings",
)

ZERO_KNOWN = ZERO_IMPLEMENTED + tuple(ZERO_DEFAULT_ONLY) + ZERO_UNSUPPORTED + ZERO_STAGE3_TUNING

TOP_READ = (
    "zero_optimization",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "seed",
    "communication_data_type",
    "data_types",
)

# Logging and bookkeeping keys with no effect on training numerics.
TOP_NO_EFFECT = (
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
)

# DeepSpeed features qwz does not implement; present is an error unless the
# value is a section with `"enabled": false`.
TOP_UNSUPPORTED = (
    "scheduler",
    "amp",
    "torch_autocast",
    "activation_checkpointing",
    "flops_profiler",
    "compression_training",
    "sparse_attention",
    "pipeline",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "autotuning",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "quantize_training",
    "checkpoint",
    "aio",
    "nebula",
    "hybrid_engine",
    "sequence_parallel_size",
    "compile",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "fp8",
)

TOP_KNOWN = TOP_READ + TOP_NO_EFFECT + TOP_UNSUPPORTED

BF16_KNOWN = ("enabled",)
FP16_KNOWN = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
    "fp16_master_weights_and_grads",
)

OPTIMIZER_PARAMS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"),
    "adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"),
    "sgd": ("lr", "momentum", "weight_decay", "dampening", "nesterov"),
}
