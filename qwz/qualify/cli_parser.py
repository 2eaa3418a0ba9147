"""The argument parser every ``qwz-qualify`` command is built with, and its one error style.

[Note: one error style]
Every refusal, whichever command and whichever layer finds it (argparse, the preflight, a
record that cannot be trusted, a file that cannot be written), is one line on stderr,
``qwz-qualify COMMAND: error: MESSAGE``, and the exit status 2 ([Note: exit statuses] in
qualify/base/exit_codes.py). :func:`refuse` prints it for the commands; :class:`Parser` for
argparse, with three more rules:

- No abbreviated flags (``allow_abbrev=False``): ``--ou DIR`` is not ``--out DIR``. A
  prefix that argparse expands silently could set a flag the user never named (``bisect``
  refuses ``--out``/``--force`` after ``--`` by their full names, which an abbreviation
  slipped past).
- A misspelt flag is refused with the flag it most resembles: ``--worklaod`` says
  ``did you mean --workload?``.
- ``--help`` shows every argument's default and ends with the exit-status table.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from qwz.qualify.base import exit_codes


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown (where it is None, the help says what that means); the
    description and the exit-status epilog keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """[Note: one error style]: a parser without abbreviations whose unknown flags get a
    suggestion, and whose help ends with the exit-status table."""

    def __init__(self, *args: Any, usage_error_status: int = exit_codes.REFUSED, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", exit_codes.epilog())
        super().__init__(*args, **kwargs)
        self.usage_error_status = usage_error_status
        """2; ``bisect-step``'s 128, which git reads as "abort" (2 would mark a commit bad)."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(self.usage_error_status, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but arguments nobody took are refused by the command they were
        given to (its program name, its flags suggested), not by the top-level parser."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen_command(parsed) or self
            parser.error(unrecognized(extras, parser))
        return parsed

    def _chosen_command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None) or "")
        return None


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the closest flag of `parser` for
    each unknown one (``--worklaod`` -> ``did you mean --workload?``)."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if not flag.startswith("--") or flag in known:
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return message + (f" ({'; '.join(hints)})" if hints else "")


def refuse(command: str, *problems: str) -> int:
    """Print each problem as ``qwz-qualify COMMAND: error: PROBLEM`` on stderr; exit 2."""
    for problem in problems:
        print(f"qwz-qualify {command}: error: {problem}", file=sys.stderr)
    return exit_codes.REFUSED
