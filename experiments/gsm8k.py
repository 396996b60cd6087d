"""GRPO / GRPO-GA / GRPO-PODS on GSM8K: `python -m experiments.gsm8k --mesh 8 --out runs/gsm8k`."""

import sys

from experiments.cli import main

if __name__ == "__main__":
    sys.exit(main("gsm8k"))
