"""`qwz-qualify run --help` states every option's default (the README points there)."""

from __future__ import annotations

import argparse

from qwz.qualify.cli import build_parser


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["run"]


def test_every_run_option_shows_its_default():
    run = _run_parser()
    formatter = run.formatter_class(prog="qwz-qualify run")
    missing = []
    for action in run._actions:
        if not action.option_strings or action.required or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        if "default" not in shown:
            missing.append(action.option_strings[0])
    assert not missing, f"run --help shows no default for {missing}"
    assert "(default: 20)" in run.format_help(), "the formatter does not print defaults"
