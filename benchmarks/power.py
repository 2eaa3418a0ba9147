"""How sensitive the judge is: the power table of the learning verdict.

    python benchmarks/power.py --seeds 3 --out runs/power      # writes runs/power/power.md

Every injector of benchmarks/injectors.py (gradient noise, late gradients, lost moments,
a learning rate off) is run at its graded strengths, with the correct candidate beside
them, under the ``default`` preset's 20-step qualification and the ``long`` preset
(qualify/base/presets.py), on the same workload (``mlp-small``: the long preset's CPU
workload, so the two columns differ in the horizon and the rule alone) over S seeds.
Per (preset, seed) one run trains the reference and the calibration arm once and every
candidate after them (injectors.PowerPlan); each candidate is judged by its own checks,
exactly as a run of it alone (the arms are deterministic). A candidate is *caught* when
any of its checks fails (the verdict a run of it alone would give: FAIL); the correct
candidate's failures are false failures.

Each (preset, seed) run writes ``<out>/<preset>-seed<k>/record.json``; a rerun reuses the
records it finds (resumable) and re-derives every check from them, so the table always
follows from the evidence code of this checkout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import injectors
from qwz.qualify.base.plan import RunPlan
from qwz.qualify.base.presets import PRESETS
from qwz.qualify.evidence import build, checks, record
from qwz.qualify.evidence.schema import Record
from qwz.qualify.run.workloads import get_workload

WORKLOAD = "mlp-small"
ALL = (injectors.CORRECT, *injectors.INJECTORS)
HOOK = "benchmarks.injectors:by_arm"


def power_plan(preset_name: str, seed: int, names: Sequence[str], steps: int | None):
    preset = PRESETS[preset_name]
    chosen = {  # the preset's values, else the settings' declared defaults
        name: preset.values.get(name, getattr(RunPlan, name))
        for name in ("steps", "eval_every", "held_out_batches", "learning_rule")
    }
    return injectors.PowerPlan(
        workload=get_workload(WORKLOAD),
        steps=steps or chosen["steps"],
        eval_every=chosen["eval_every"],
        held_out_batches=chosen["held_out_batches"],
        learning_rule=chosen["learning_rule"],
        preset=preset.name,
        blocks=0,  # speed is not what the table measures
        seed=seed,
        kernels="fused",
        arm_hook=HOOK,
        injectors=tuple(names),
    )


def run_one(plan, path: pathlib.Path, timeout_s: float) -> float:
    """Train the plan's arms on two local ranks and save the record; the wall seconds."""
    from qwz.qualify.run.launch import launch
    from qwz.qualify.run.runner import qualify_rank

    started = time.perf_counter()
    observations = launch(qualify_rank, 2, plan, timeout_s=timeout_s)[0]
    built = build.build_record(plan, observations)
    path.parent.mkdir(parents=True, exist_ok=True)
    record.save(built, path)
    return time.perf_counter() - started


def judged(path: pathlib.Path) -> dict[str, list[str]]:
    """Per injector, the names of its candidate's failing checks, re-derived from the
    record with this checkout's evidence code (None-free: [] is a pass)."""
    stored = Record.model_validate(json.loads(path.read_text()))
    derived = checks.derive(stored)
    size = stored.arms[-1].group_size
    caught: dict[str, list[str]] = {}
    for arm in stored.arms:
        if arm.role != "candidate":
            continue
        name = arm.name.removeprefix(f"candidate-g{size}-")
        failing = [c.name.split("[")[0] for c in derived if c.name.endswith(f"[{arm.name}]")]
        statuses = [c.status for c in derived if c.name.endswith(f"[{arm.name}]")]
        caught[name] = [
            family for family, status in zip(failing, statuses, strict=True) if status == "fail"
        ]
        if "inconclusive" in statuses and not caught[name]:
            caught[name] = ["(inconclusive)"]
    return caught


def table(results: dict[str, dict[int, dict[str, list[str]]]], names: Sequence[str]) -> str:
    """The markdown power table: per injector and preset, caught / seeds and by which
    checks; the correct candidate's row counts false failures."""
    presets = list(results)
    header = ["candidate", *(f"`{preset}`" for preset in presets)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = [f"`{name}`" if name != injectors.CORRECT else "correct (false failures)"]
        for preset in presets:
            per_seed = [
                results[preset][seed][name]
                for seed in sorted(results[preset])
                if name in results[preset][seed]
            ]
            caught = sum(1 for failing in per_seed if failing and failing != ["(inconclusive)"])
            families = sorted({family for failing in per_seed for family in failing})
            counts = [f"{f} {sum(f in failing for failing in per_seed)}" for f in families]
            which = f" ({', '.join(counts)})" if families else ""
            cells.append(f"{caught}/{len(per_seed)}{which}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="records and power.md")
    parser.add_argument("--seeds", type=int, default=3, help="seeds: first .. first + S - 1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--long-seeds",
        type=int,
        default=None,
        help="the long preset's injected rows on the first M seeds only (the correct row on "
        "all of them); default: all",
    )
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    parser.add_argument(
        "--injectors", nargs="+", choices=ALL, default=list(ALL), help="rows (default: all)"
    )
    parser.add_argument(
        "--long-steps", type=int, default=None, help="override the long preset's horizon"
    )
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.first_seed < 0 or (args.long_seeds or 1) < 1:
        parser.error("--seeds and --long-seeds must be >= 1, --first-seed >= 0")
    return args


def _tag(names: Sequence[str]) -> str:
    """A record directory's suffix: which candidates its run trained."""
    if list(names) == list(ALL):
        return "all"
    return "+".join(name.replace("-", "") for name in names)


def _run_all(args: argparse.Namespace) -> dict[str, list[float]]:
    """Every (preset, seed) run of the invocation whose record is not there yet."""
    walls: dict[str, list[float]] = {}
    for preset in args.presets:
        steps = args.long_steps if preset == "long" else None
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            names = list(args.injectors)
            late_seed = args.long_seeds is not None and seed >= args.first_seed + args.long_seeds
            if preset == "long" and late_seed:
                names = [name for name in names if name == injectors.CORRECT]
            if not names:
                continue
            path = args.out / f"{preset}-seed{seed}-{_tag(names)}" / "record.json"
            if path.exists():
                continue
            wall = run_one(power_plan(preset, seed, names, steps), path, args.timeout)
            walls.setdefault(preset, []).append(wall)
            print(f"{preset} seed {seed} {_tag(names)}: {wall:.0f} s", file=sys.stderr)
    return walls


def collect(out: pathlib.Path) -> dict[str, dict[int, dict[str, list[str]]]]:
    """Per preset and seed, every candidate's failing checks, over every record under
    `out` (``<preset>-seed<k>-<tag>/record.json``; a candidate in several is judged alike)."""
    results: dict[str, dict[int, dict[str, list[str]]]] = {}
    for path in sorted(out.glob("*-seed*-*/record.json")):
        preset, _, rest = path.parent.name.partition("-seed")
        seed = int(rest.split("-")[0])
        results.setdefault(preset, {}).setdefault(seed, {}).update(judged(path))
    return {preset: results[preset] for preset in PRESETS if preset in results}


def main(argv: Sequence[str] | None = None) -> int:
    import os

    args = _parse(argv)
    load_before, started = os.getloadavg(), time.perf_counter()
    walls = _run_all(args)
    elapsed = time.perf_counter() - started
    ran = ", ".join(f"{p}: {len(w)} runs, {sum(w):.0f} s" for p, w in walls.items()) or "none"
    text = (
        f"Workload `{WORKLOAD}`, 2 ranks, G = 64; caught = any check of the candidate "
        "fails; a/b = caught in a of b seeds; in brackets, each failing check and in how many "
        "seeds it failed.\n\n"
        + table(collect(args.out), ALL)
        + f"\nThis invocation: wall {elapsed:.0f} s ({ran}); load average "
        f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
        "CPUs.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "power.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
