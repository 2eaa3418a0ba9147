"""The README a newcomer reads: what qwz is and the two commands on its first screen, the
test command CI runs, live links, and no number that nothing generates (benchmark timings,
speed-ups, old commit hashes belong in docs/benchmarks.md, which a command rewrites)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:25])


def test_first_screen_says_what_and_gives_the_two_commands():
    assert "qwz" in FIRST_SCREEN.split("```")[0], "what qwz is comes after the commands"
    assert "It is for" in FIRST_SCREEN, "the first screen does not say whom qwz is for"
    assert "bash ci/qualify-cpu.sh" in FIRST_SCREEN
    assert "bash ci/test.sh" in FIRST_SCREEN


def test_ci_runs_exactly_the_readmes_test_command():
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert commands == ["bash ci/test.sh"], commands


def test_no_hand_written_measurements_or_commit_hashes():
    speedups = re.findall(r"\b\d+\.\d+x\b", README)
    timings = re.findall(r"\b\d+(?:\.\d+)?\s?(?:ms|GiB|MB/s|GB/s)\b", README)
    hashes = [h for h in re.findall(r"`([0-9a-f]{7,40})`", README) if re.search(r"\d", h)]
    assert not speedups, f"speed-ups in the README: {speedups}"
    assert not timings, f"measurements in the README: {timings}"
    assert not hashes, f"commit hashes in the README: {hashes}"


def test_relative_links_resolve():
    targets = re.findall(r"\]\((?!https?://)([^)#]+)\)", README)
    assert "docs/benchmarks.md" in targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"dead links: {missing}"
