"""The requalification harness: run reference and candidate arms, check, record, report, compare.

Entry points: ``qwz-qualify`` / ``python -m qwz.qualify`` (cli.py).
"""
