"""JUnit XML of a record's checks and of ``compare``'s gate, for CI test reporters.

[Note: JUnit mapping]
GitHub (test-reporter actions), GitLab (``artifacts:reports:junit``) and Jenkins (the JUnit
plugin) read the same subset: ``<testsuites>`` holding ``<testsuite name tests failures
errors skipped>`` holding ``<testcase classname name>``, a test case failing with a
``<failure message type>``, erring with an ``<error>``, skipped with a ``<skipped
message>``. A record's checks map one to one: ``pass`` is a plain test case, ``fail`` a
``<failure>``, ``n/a`` (nothing to test) a ``<skipped>`` with its reason, and
``inconclusive`` an ``<error type="inconclusive">``: not a failure of the code under test,
but never green, as ``run`` exits 3 for it. Every test case carries the check's detail as
its message (and as ``<system-out>``), so the reporter shows what the report says. The
suite's ``<properties>`` name the head, subject and verdict. Compare's gate is one test
case: failing for a regression (one line per regression), erring when the records are not
comparable.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from qwz.qualify.evidence.schema import Record
from qwz.qualify.review.banner import banner
from qwz.qualify.review.compare import Status

JUNIT_STATUS = {"fail": "failure", "n/a": "skipped", "inconclusive": "error"}


def _testsuites(suites: list[ElementTree.Element]) -> str:
    root = ElementTree.Element("testsuites")
    for attribute in ("tests", "failures", "errors", "skipped"):
        root.set(attribute, str(sum(int(suite.get(attribute, "0")) for suite in suites)))
    root.extend(suites)
    ElementTree.indent(root)
    return ElementTree.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _suite(name: str, properties: dict[str, str]) -> ElementTree.Element:
    suite = ElementTree.Element("testsuite", name=name)
    listed = ElementTree.SubElement(suite, "properties")
    for key, value in properties.items():
        ElementTree.SubElement(listed, "property", name=key, value=value)
    return suite


def _count(suite: ElementTree.Element) -> None:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for tag, attribute in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        suite.set(attribute, str(sum(case.find(tag) is not None for case in cases)))


def _case(classname: str, name: str, outcome: str | None, message: str, kind: str = ""):
    case = ElementTree.Element("testcase", classname=classname, name=name, time="0")
    if outcome is not None:
        ElementTree.SubElement(case, outcome, message=message, type=kind or outcome).text = message
    ElementTree.SubElement(case, "system-out").text = message
    return case


def record_junit(record: Record) -> str:
    """[Note: JUnit mapping] of every check of `record`."""
    classname = f"qwz.qualify.{record.subject.name}.{record.workload.name}"
    suite = _suite(
        f"qwz-qualify {record.subject.name} {record.workload.name} {record.head.sha[:12]}",
        {
            "head": record.head.sha,
            "dirty": str(record.head.dirty).lower(),
            "subject": record.subject.name,
            "verdict": banner(record),
            "digest": record.digest,
            "created_at": record.created_at,
        },
    )
    for check in record.checks:
        outcome = JUNIT_STATUS.get(check.status)
        suite.append(_case(classname, check.name, outcome, check.detail, check.status))
    _count(suite)
    return _testsuites([suite])


def comparison_junit(comparison) -> str:
    """Compare's gate (qualify/review/compare.py) as one test case ([Note: JUnit mapping])."""
    suite = _suite("qwz-qualify compare", {"status": comparison.status.name.lower()})
    lines = comparison.lines
    if comparison.status == Status.REGRESSION:
        found = [line for line in lines if line.startswith("REGRESSION: ")]
        outcome, message, kind = "failure", "\n".join(found), "regression"
    elif comparison.status == Status.NOT_COMPARABLE:
        found = [line for line in lines if line.startswith("NOT COMPARABLE: ")]
        outcome, message, kind = "error", "\n".join(found), "not-comparable"
    else:
        outcome, message, kind = None, "no regression", ""
    case = _case("qwz.qualify.compare", "regression-gate", outcome, message, kind)
    case.find("system-out").text = "\n".join(lines)
    suite.append(case)
    _count(suite)
    return _testsuites([suite])


def history_junit(nights, problems: list[str]) -> str:
    """Every record under a history directory as a test case (its verdict, [Note: JUnit
    mapping]); a record that could not be loaded is an erring test case."""
    suite = _suite("qwz-qualify history", {"records": str(len(nights))})
    outcomes = {"FAIL": "failure", "INCONCLUSIVE": "error"}
    for night in nights:
        verdict = night.record.verdict.status
        outcome = outcomes.get(verdict)
        suite.append(
            _case("qwz.qualify.history", f"{night.label} {night.path}", outcome,
                  banner(night.record), verdict.lower())
        )  # fmt: skip
    for index, problem in enumerate(problems):
        suite.append(_case("qwz.qualify.history", f"unloadable {index}", "error", problem))
    _count(suite)
    return _testsuites([suite])
