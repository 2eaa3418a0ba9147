"""The repository ci/gpu-review.sh reviews: the installed DeepSpeed committed as the base, and
tests/deepspeed_native/proposal.patch committed on top as the head (tests/deepspeed_checkout.py).

    python ci/review_checkout.py DIR     # prints the repository's root (DIR/DeepSpeed)
"""

from __future__ import annotations

import pathlib
import sys

from tests.deepspeed_checkout import make_checkout, read_patch


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python ci/review_checkout.py DIR", file=sys.stderr)
        return 2
    print(make_checkout(pathlib.Path(argv[0]), read_patch("proposal")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
