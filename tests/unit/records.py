"""A synthetic evidence record for the unit tests of record, compare and report.

``make_payload`` returns the payload a two-rank qualification of the tiny Qwen3
workload would write (a reference arm ``reference``, a candidate arm
``candidate-g64``, four speed blocks, every check passing), with every value spelled
out in its JSON type so that ``record.seal`` digests exactly what ``record.save``
writes. ``make_record`` seals it.

Overrides replace top-level keys; a dict override is merged into the default dict
(``environment={"world_size": 4}``), a list override replaces the list. Unless
``verdict`` is overridden it follows from the checks.
"""

from __future__ import annotations

import copy
import hashlib
import math
import statistics
from typing import Any

from qwz.qualify import record, stats

REFERENCE = "reference"
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


def _performance() -> dict[str, Any]:
    return make_performance()


def make_performance(
    speed_scale: float = 1.0, jitter: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
) -> dict[str, Any]:
    """The candidate's performance entry with its step times divided by ``speed_scale``
    (0.985: 1.5% slower) and block ``i``'s candidate time multiplied by ``1 + jitter[i]``
    (block noise, which widens the bootstrap interval). The defaults give the entry
    ``make_payload`` uses."""
    candidate_step_s = [
        step_s / speed_scale * (1.0 + noise)
        for step_s, noise in zip(CANDIDATE_STEP_S, jitter, strict=True)
    ]
    speedups = [r / c for r, c in zip(REFERENCE_STEP_S, candidate_step_s, strict=True)]
    ci_low, ci_high = stats.bootstrap_median_ci(speedups)
    return {
        "arm": CANDIDATE,
        "block_steps": 10,
        "warmup_steps": 3,
        "blocks": [
            {
                "index": index,
                "order": "AB" if index % 2 == 0 else "BA",
                "reference_step_s": reference_s,
                "candidate_step_s": candidate_s,
                "speedup": speedup,
            }
            for index, (reference_s, candidate_s, speedup) in enumerate(
                zip(REFERENCE_STEP_S, candidate_step_s, speedups, strict=True)
            )
        ],
        "median_speedup": statistics.median(speedups),
        "ci_low": ci_low,
        "ci_high": ci_high,
        "ci_method": stats.describe_ci(0.95, 10_000, 0),
        "p_value": stats.paired_p_value(REFERENCE_STEP_S, candidate_step_s),
        "test": f"{stats.TEST_DESCRIPTION}, 4 blocks",
        "memory": [
            {
                "rank": rank,
                "kind": "cuda",
                "peak_allocated_bytes": 61_341_696 + 4_096 * rank,
                "peak_reserved_bytes": 81_788_928,
            }
            for rank in range(2)
        ],
    }


def _checks() -> list[dict[str, Any]]:
    return [
        {
            "name": "losses-finite",
            "passed": True,
            "detail": "all 20 losses and gradient norms of both arms are finite",
            "numbers": {"steps": STEPS, "non_finite": 0},
        },
        {
            "name": "tolerance",
            "passed": True,
            "detail": "0 of 10240 sampled parameters outside the bound (max ratio 0.41)",
            "numbers": {"checked": 10240, "violations": 0, "max_ratio": 0.412},
        },
        {
            "name": "replicas-identical",
            "passed": True,
            "detail": "final parameter hash equal on both ranks, for both arms",
            "numbers": {"ranks": 2},
        },
        {
            "name": "group-size-probe",
            "passed": True,
            "detail": "every rank reports group size 64 for candidate-g64",
            "numbers": {"requested": 64, "reported": [64, 64]},
        },
        {
            "name": "wire-bytes",
            "passed": True,
            "detail": "candidate gather sends 0.531x the reference bytes (expected 0.531x)",
            "numbers": {"ratio": 0.53125},
        },
    ]


def make_payload(**overrides: Any) -> dict[str, Any]:
    """The payload of a passing two-rank qualification, with ``overrides`` applied."""
    payload: dict[str, Any] = {
        "schema_version": record.SCHEMA_VERSION,
        "created_at": "2025-06-02T14:31:07+00:00",
        "head": {"repository": "https://example.org/qwz.git", "sha": HEAD_SHA, "dirty": False},
        "subject": {"name": "qwz", "version": "0.1.0", "sha": HEAD_SHA},
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
        "arms": [
            {
                "name": REFERENCE,
                "quantized": False,
                "group_size": None,
                "stage": 2,
                "dtype": "bfloat16",
                "kernels": "compiled",
                "integration_enabled": True,
                "config": _arm_config(quantized=False),
            },
            {
                "name": CANDIDATE,
                "quantized": True,
                "group_size": 64,
                "stage": 2,
                "dtype": "bfloat16",
                "kernels": "compiled",
                "integration_enabled": True,
                "config": _arm_config(quantized=True),
            },
        ],
        "trajectories": [
            {"arm": REFERENCE, "losses": _losses(0.0), "grad_norms": _grad_norms()},
            {"arm": CANDIDATE, "losses": _losses(0.0004), "grad_norms": _grad_norms()},
        ],
        "tolerance": [
            {
                "arm": CANDIDATE,
                "bound": "|w_q - w_r| <= D_t + scale/2 + ulp(|w_r|) + ulp(|w_q|)",
                "samples_per_step": 512,
                "steps": STEPS,
                "checked": 10240,
                "violations": 0,
                "max_ratio": 0.412,
                "own_shard_max_ratio": 0.998,
                "max_abs_error": 0.000731,
            }
        ],
        "hashes": [
            {
                "arm": arm,
                "per_rank": [fake_hash(arm)] * 2,
                "ledger_status": "reproduced",
                "ledger_previous": fake_hash(arm),
            }
            for arm in (REFERENCE, CANDIDATE)
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
            }
        ],
        "performance": [_performance()],
        "checks": _checks(),
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(payload.get(key), dict):
            payload[key] = {**payload[key], **copy.deepcopy(value)}
        else:
            payload[key] = copy.deepcopy(value)
    if "verdict" not in overrides:
        checks = [record.Check.model_validate(check) for check in payload["checks"]]
        payload["verdict"] = record.verdict_of(checks).model_dump(mode="json")
    return payload


def make_record(**overrides: Any) -> record.Record:
    """``make_payload(**overrides)``, validated and sealed with its digest."""
    return record.seal(make_payload(**overrides))
