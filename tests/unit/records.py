"""A synthetic evidence record for the unit tests of record, compare and report.

``make_payload`` returns the raw observations a two-rank qualification of the
tiny Qwen3 workload would record (arms ``reference``, ``calibration-g64`` and
``candidate-g64``, four speed blocks, every check passing), with every value
spelled out in its JSON type. ``make_record`` seals it: ``seal.seal`` derives
the checks and the verdict from the observations, as ``record.load`` does again.

Overrides replace top-level keys; a dict override is merged into the default dict
(``environment={"world_size": 4}``), a list override replaces the list.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import pathlib
from typing import Any

from qwz.qualify.evidence import schema, seal
from qwz.qualify.evidence.rules import speed

REFERENCE = "reference"
CALIBRATION = "calibration-g64"
CANDIDATE = "candidate-g64"
HEAD_SHA = "3f9c2a4e8b7d1c0a5e6f7b8c9d0e1f2a3b4c5d6e"
STEPS = 20
NUM_PARAMETERS = 1_158_528

# Median step time per block, seconds: a 3.7% speed-up, the orders AB, BA, AB, BA.
REFERENCE_STEP_S = [0.041532, 0.041498, 0.041611, 0.041570]
CANDIDATE_STEP_S = [0.040048, 0.040054, 0.040049, 0.040082]


def fake_hash(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def _losses(wiggle: float) -> list[float]:
    # Cross-entropy of a random init over a 2048-token vocabulary starts near ln(2048).
    return [
        round(5.1 + 2.52 * math.exp(-step / 6.0) + wiggle * math.sin(step), 6)
        for step in range(STEPS)
    ]


def _grad_norms() -> list[float]:
    return [round(0.8 + 1.9 * math.exp(-step / 4.0), 6) for step in range(STEPS)]


def _arm_config(quantized: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 2, "allgather_bucket_size": 50_000_000}
    if quantized:
        zero |= {"zero_quantized_weights": True, "zero_quantized_weights_group_size": 64}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _blocks(
    speed_scale: float = 1.0, jitter: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
) -> list[dict[str, Any]]:
    # Five timed steps per arm and block around the block medians above.
    return [
        {
            "order": "AB" if index % 2 == 0 else "BA",
            "reference_times_s": [
                reference_s * factor for factor in (0.998, 1.0, 1.004, 0.999, 1.01)
            ],
            "candidate_times_s": [
                candidate_s / speed_scale * (1.0 + noise) * factor
                for factor in (1.003, 0.997, 1.0, 1.02, 0.999)
            ],
        }
        for index, (reference_s, candidate_s, noise) in enumerate(
            zip(REFERENCE_STEP_S, CANDIDATE_STEP_S, jitter, strict=True)
        )
    ]


def _memory(arm: str) -> list[dict[str, Any]]:
    return [
        {
            "arm": arm,
            "rank": rank,
            "kind": "cuda",
            "peak_allocated_bytes": 61_341_696 + 4_096 * rank,
            "peak_reserved_bytes": 81_788_928,
            "staging_peak_bytes": 0 if arm == REFERENCE else 98_816,
            "staging_largest": [] if arm == REFERENCE else [[16_384, "zero/gather.py:95 in run"]],
        }
        for rank in range(2)
    ]


def _performance() -> dict[str, Any]:
    return make_performance()


def make_performance(
    speed_scale: float = 1.0, jitter: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
) -> dict[str, Any]:
    """The candidate's performance entry with its step times divided by ``speed_scale``
    (0.985: 1.5% slower) and block ``i``'s candidate times multiplied by ``1 + jitter[i]``
    (block noise, which widens the bootstrap interval). The defaults give the entry
    ``make_payload`` uses."""
    return {
        "arm": CANDIDATE,
        "block_steps": 5,
        "warmup_steps": 3,
        **speed.summarize_blocks(_blocks(speed_scale, jitter)),
        "memory": _memory(CANDIDATE),
    }


EVAL_STEPS = [0, 5, 10, 15, 20]
HELD_OUT = {
    REFERENCE: [7.6728, 7.0256, 6.7207, 6.3191, 5.8716],
    CALIBRATION: [7.6728, 7.0257, 6.7213, 6.3195, 5.8717],
    CANDIDATE: [7.6728, 7.0250, 6.7209, 6.3189, 5.8713],
}


def _trajectory(arm: str, wiggle: float) -> dict[str, Any]:
    return {
        "arm": arm,
        "steps_planned": STEPS,
        "losses": _losses(wiggle),
        "grad_norms": _grad_norms(),
        "held_out": [
            {"step": step, "loss": loss}
            for step, loss in zip(EVAL_STEPS, HELD_OUT[arm], strict=True)
        ],
        "failure": None,
    }


PARAMETER_NAMES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def _digests() -> dict[str, str]:
    return {name: fake_hash(name)[:16] for name in PARAMETER_NAMES}


def _updates(arm: str) -> dict[str, Any]:
    return {
        "arm": arm,
        "samples_per_shard": 512,
        "checked": 40_960,
        "violations": 0,
        "max_ratio": 0.49,
        "first_violation": None,
        "missing_steps": [],
        "norm_checked": 20,
        "norm_violations": 0,
        "norm_max_ratio": 0.01,
    }


def _arm(name: str, role: str, quantized: bool) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "quantized": quantized,
        "group_size": 64 if quantized else None,
        "stage": 2,
        "dtype": "bf16",
        "kernels": "fused",
        "qwz_gather": True,
        "config": _arm_config(quantized=quantized),
        "allgather_bucket_size": 50_000_000,
    }


ARMS = (
    (REFERENCE, "reference", False),
    (CALIBRATION, "calibration", False),
    (CANDIDATE, "candidate", True),
)


def wire_group(rank: int, bytes_per_step: int, quantized_numel: int = 579_264) -> dict[str, Any]:
    """One rank's gather over the two-rank world: its half of the parameters, all quantized
    (the spec's bytes at G = 64 are 579,264 * (1 + 4/64) = 615,468), in one collective whose
    output holds both ranks' rows."""
    return {
        "rank": rank,
        "group_ranks": [0, 1],
        "bytes_per_step": bytes_per_step,
        "calls_per_step": 1,
        "quantized_numel": quantized_numel,
        "exact_numel": 0,
        "padding_numel": 0,
        "element_bytes": 2,
        "largest_output_bytes": 2 * bytes_per_step,
    }


CONFORMANCE_FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "conformance"


def conformance_table(name: str) -> dict[str, Any]:
    """The conformance section a real subject recorded: tests/fixtures/conformance/<name>.json
    (``qwz``, ``deepspeed``, ``deepspeed-native-stock``, ``deepspeed-native-proposal``, ...)."""
    return json.loads((CONFORMANCE_FIXTURES / f"{name}.json").read_text())


def make_payload(**overrides: Any) -> dict[str, Any]:
    """The raw observations of a passing two-rank qualification, with ``overrides`` applied
    (checks and verdict are derived by ``seal.seal``)."""
    payload: dict[str, Any] = {
        "schema_version": schema.SCHEMA_VERSION,
        "created_at": "2025-06-02T14:31:07+00:00",
        "head": {"repository": "https://example.org/qwz.git", "sha": HEAD_SHA, "dirty": False},
        "harness": {"repository": "https://example.org/qwz.git", "sha": HEAD_SHA, "dirty": False},
        "subject": {"name": "qwz", "version": "0.1.0", "sha": HEAD_SHA, "dirty": False},
        "environment": {
            "python": "3.11.9",
            "torch": "2.7.1+cu128",
            "deepspeed": None,
            "transformers": "4.52.4",
            "backend": "nccl",
            "device_names": ["NVIDIA H200", "NVIDIA H200"],
            "world_size": 2,
            "node_count": 1,
            "platform": "Linux-6.8.0-x86_64-with-glibc2.39",
        },
        "workload": {
            "name": "tiny-qwen3",
            "params": {
                "hidden_size": 128,
                "intermediate_size": 384,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 2048,
                "seq_len": 128,
            },
            "num_parameters": NUM_PARAMETERS,
            "steps": STEPS,
            "seed": 1234,
        },
        "plan": {"steps": STEPS, "lr": 0.0003, "min_speedup": None},
        "arms": [_arm(*arm) for arm in ARMS],
        "trajectories": [
            _trajectory(REFERENCE, 0.0),
            _trajectory(CALIBRATION, 0.0003),
            _trajectory(CANDIDATE, 0.0004),
        ],
        "learning": {
            "eval_steps": EVAL_STEPS,
            "held_out_batches_per_rank": 2,
            "calibration_arm": CALIBRATION,
            "calibration_group_size": 64,
        },
        "step_one": [{"arm": name, "digests": _digests()} for name, _, _ in ARMS],
        "updates": [_updates(name) for name, _, _ in ARMS],
        "own_shards": [
            {"arm": REFERENCE, "max_ratio": 0.0, "first_violation": None, "checked": 81_920},
            {
                "arm": CANDIDATE,
                "max_ratio": 0.998,
                "first_violation": None,
                "checked": 81_920,
                "scheme_by_rank": ["absmax/127", "absmax/127"],
                "by_scheme": {"absmax/127": 81_920},
                "cost": {
                    "elements": 81_920,
                    "written_worst": 0.003937,
                    "written_mean": 0.000985,
                    "absmax127_worst": 0.003937,
                    "absmax127_mean": 0.000985,
                    "cast_worst": 0.001953,
                    "cast_mean": 0.000488,
                    "cast_dtype": "bfloat16",
                    "fp16_below_normal": 0,
                    "fp16_overflow": 0,
                },
            },
        ],
        "drift": [
            {
                "arm": name,
                "samples_per_param": 64,
                "max_abs_error": [0.0073] * STEPS,
                "bound": [0.002 * (step + 1) for step in range(STEPS)],
            }
            for name in (CALIBRATION, CANDIDATE)
        ],
        "hashes": [
            {
                "arm": name,
                "per_rank": [fake_hash(name)] * 2,
                "divergence": None,
                "ledger_status": "reproduced",
                "ledger_previous": fake_hash(name),
                "ledger_siblings": {},
            }
            for name, _, _ in ARMS
        ],
        "probes": [
            {
                "arm": CANDIDATE,
                "requested_group_size": 64,
                "reported_group_sizes": [64, 64],
                # Rank 0's half of 1,158,528 bf16 parameters: 2 bytes each unquantized,
                # 1 + 4/64 bytes quantized.
                "gather_bytes_per_step": 615_468,
                "reference_gather_bytes_per_step": 1_158_528,
                "reported_by": ["optimizer.quantization_group_size"] * 2,
                "wire": [wire_group(rank, 615_468) for rank in (0, 1)],
            }
        ],
        "memory": [item for name, _, _ in ARMS for item in _memory(name)],
        "performance": [_performance()],
        "conformance": conformance_table("qwz"),
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(payload.get(key), dict):
            payload[key] = {**payload[key], **copy.deepcopy(value)}
        else:
            payload[key] = copy.deepcopy(value)
    return payload


def make_step_masters(arms=tuple(name for name, _, _ in ARMS), steps: int = STEPS) -> list:
    """``step_masters`` for `arms`: each parameter's short digest after every step (made up,
    the same for the same arm, parameter and step)."""
    return [
        {
            "arm": arm,
            "digests": [
                {name: fake_hash(f"{arm}/{name}/{step}")[:8] for name in PARAMETER_NAMES}
                for step in range(1, steps + 1)
            ],
        }
        for arm in arms
    ]


def violation(step: int, rank: int, ratio: float, what: str = "expected 0.1, got 0.2"):
    """A first violation of lm_head.weight[12], as the update and own-shard checks record."""
    return {
        "step": step,
        "rank": rank,
        "parameter": "lm_head.weight",
        "index": 12,
        "what": what,
        "ratio": ratio,
    }


def non_finite_failure(step: int, rank: int, message: str) -> dict[str, Any]:
    """An arm that stopped at `step` on both ranks with a NaN/Inf in lm_head.weight."""
    return {
        "step": step,
        "rank": rank,
        "ranks": [0, 1],
        "kind": "non-finite",
        "message": message,
        "parameters": ["lm_head.weight"],
    }


def make_record(**overrides: Any) -> schema.Record:
    """``make_payload(**overrides)``, validated and sealed with its digest."""
    return seal.seal(make_payload(**overrides))
