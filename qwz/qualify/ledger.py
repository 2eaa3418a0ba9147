"""The hash ledger: final parameter hashes stored under (head SHA, environment, workload, arm).

A later run of the same head in the same environment must reproduce the stored
hashes exactly. A mismatch never overwrites the stored entry, so the failure
stays visible until someone removes the entry on purpose.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Literal, NamedTuple


class LedgerResult(NamedTuple):
    status: Literal["reproduced", "recorded", "mismatch"]
    previous: str | None
    """The stored hash (for 'reproduced' and 'mismatch')."""
    siblings: dict[str, str]
    """Other arms stored for the same head, environment and workload: a short description
    of the arm (quantization and group size) -> its final hash."""


def _key(head_sha: str, fingerprint: str, workload: dict[str, Any], arm: dict[str, Any]) -> str:
    payload = {"head": head_sha, "environment": fingerprint, "workload": workload, "arm": arm}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_and_record(
    directory: pathlib.Path,
    *,
    head_sha: str,
    fingerprint: str,
    workload: dict[str, Any],
    arm: dict[str, Any],
    final_hash: str,
) -> LedgerResult:
    """Compare `final_hash` with the stored one for this key, storing it if there is none."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{_key(head_sha, fingerprint, workload, arm)}.json"
    siblings = _siblings(directory, path, head_sha, fingerprint, workload)
    if path.exists():
        try:
            stored = json.loads(path.read_text())["final_hash"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{path}: corrupt ledger entry ({error}); remove it to re-record"
            ) from None
        if stored == final_hash:
            return LedgerResult("reproduced", stored, siblings)
        return LedgerResult("mismatch", stored, siblings)
    entry = {
        "head": head_sha,
        "environment": fingerprint,
        "workload": workload,
        "arm": arm,
        "final_hash": final_hash,
    }
    path.write_text(json.dumps(entry, indent=2, sort_keys=True) + "\n")
    return LedgerResult("recorded", None, siblings)


def describe_arm(arm: dict[str, Any]) -> str:
    """The arm's name and what it sends: "reference (unquantized)", "candidate-g64 (group
    size 64)", and the shard alignment where the engine took one. The name tells apart arms
    that send alike (the reference and the calibration arm are both unquantized), which
    would otherwise overwrite each other as siblings."""
    kind = "unquantized" if not arm.get("quantized") else f"group size {arm.get('group_size')}"
    if arm.get("shard_alignment"):  # [Note: padding rule], qwz/layout.py
        kind += f", shards aligned to {arm['shard_alignment']}"
    return f"{arm['name']} ({kind})" if arm.get("name") else kind


def _siblings(
    directory: pathlib.Path,
    own_path: pathlib.Path,
    head_sha: str,
    fingerprint: str,
    workload: dict[str, Any],
) -> dict[str, str]:
    found = {}
    for path in sorted(directory.glob("*.json")):
        if path == own_path:
            continue
        try:
            entry = json.loads(path.read_text())
            same = (entry["head"], entry["environment"], entry["workload"]) == (
                head_sha,
                fingerprint,
                workload,
            )
            if same:
                found[describe_arm(entry["arm"])] = entry["final_hash"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a corrupt neighbour is reported when its own key is checked
    return found


ENTRY_KEYS = ("head", "environment", "workload", "arm", "final_hash")


def validate_directory(directory: pathlib.Path) -> list[str]:
    """Problems that would make the ledger fail a run after training: one line each.

    Call before any training. The directory need not exist (the first run creates it);
    if it does, it must be a writable directory whose every ``*.json`` entry is a readable,
    bounded UTF-8 JSON object with the entry keys."""
    from qwz import jsonio
    from qwz.qualify.files import writable_directory_problem

    problem = writable_directory_problem(directory, "--ledger")
    if problem or not directory.exists():
        return [problem] if problem else []
    problems = []
    for path in sorted(directory.glob("*.json")):
        try:
            entry = jsonio.read_json_file(path, what="ledger entry")
        except jsonio.JsonInputError as error:
            problems.append(f"--ledger: corrupt entry {error}; remove it to re-record")
            continue
        missing = [key for key in ENTRY_KEYS if not isinstance(entry, dict) or key not in entry]
        if missing or not isinstance(entry.get("final_hash"), str):
            what = f"missing {', '.join(missing)}" if missing else "final_hash is not a string"
            problems.append(f"--ledger: corrupt entry {path}: {what}; remove it to re-record")
    return problems
