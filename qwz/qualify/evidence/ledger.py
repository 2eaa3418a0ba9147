"""The hash ledger: final parameter hashes stored under (code, environment, workload, arm).

A later run of the same code in the same environment must reproduce the stored
hashes exactly. A mismatch never overwrites the stored entry, so the failure
stays visible until someone removes the entry on purpose.

[Note: ledger key]
"The same code" is :func:`code_identity`: the subject's identity (name, version, the
live commit, dirty flag and diff digest of the checkout its package was imported from,
a wheel's ``direct_url.json``), the record's head and the harness's (qwz's) head, each
with its SHA, dirty flag and diff digest -- never the directory it ran in. So two
DeepSpeed commits of one version, or one commit with and without an uncommitted edit,
are different keys, and the same commit in the same environment finds its own entry.
The entry's ``head`` field holds that identity.
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


def code_identity(subject: Any, head: Any, harness: Any | None) -> dict[str, Any]:
    """[Note: ledger key]: what identifies the code that produced a hash. `subject` is a
    record Subject, `head` and `harness` record Heads."""

    def checkout(item: Any) -> dict[str, Any] | None:
        if item is None:
            return None
        return {"sha": item.sha, "dirty": item.dirty, "diff_sha256": item.diff_sha256}

    return {"subject": subject.identity(), "head": checkout(head), "harness": checkout(harness)}


def _key(
    code: dict[str, Any], fingerprint: str, workload: dict[str, Any], arm: dict[str, Any]
) -> str:
    payload = {"head": code, "environment": fingerprint, "workload": workload, "arm": arm}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_and_record(
    directory: pathlib.Path,
    *,
    code: dict[str, Any],
    fingerprint: str,
    workload: dict[str, Any],
    arm: dict[str, Any],
    final_hash: str,
) -> LedgerResult:
    """Compare `final_hash` with the stored one for this key ([Note: ledger key]: `code`
    from :func:`code_identity`), storing it if there is none."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{_key(code, fingerprint, workload, arm)}.json"
    siblings = _siblings(directory, path, code, fingerprint, workload)
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
        "head": code,
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
    code: dict[str, Any],
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
                code,
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
    from qwz.qualify.base.files import writable_directory_problem

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
