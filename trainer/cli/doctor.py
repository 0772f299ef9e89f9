"""`trainer-doctor`: the preflight checks (trainer.cluster.doctor, which the launcher runs too), and with --data DIR
every image file of a data folder decoded as training would (trainer.data.check)."""

from __future__ import annotations

import sys
from typing import Sequence

from trainer.cluster import doctor
from trainer.data import check


def main(argv: Sequence[str] | None = None) -> int:
    return doctor.main(argv, data_check=check.main)


if __name__ == "__main__":
    sys.exit(main())
