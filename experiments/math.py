"""GRPO / GRPO-GA / GRPO-PODS on MATH: `python -m experiments.math --mesh 8 --out runs/math`."""

import sys

from experiments.cli import main

if __name__ == "__main__":
    sys.exit(main("math"))
