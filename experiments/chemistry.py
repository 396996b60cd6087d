"""GRPO / GRPO-GA / GRPO-PODS on chemistry (setting d's stand-in: SciBench's chemistry problems).

    python -m experiments.chemistry --model /ckpt/Qwen2.5-3B-Instruct --dataset data/chemistry \
        --setting d --out runs/chemistry

The paper's chemistry dataset is not named in what is reachable; this task stands in
for it (see ``podsjax.data.datasets``). There is no Hub default, so --dataset (or --data and
--eval-data) is needed with --model; any file with problem/answer/unit rows works the same way.
"""

import sys

from experiments.cli import main

if __name__ == "__main__":
    sys.exit(main("chemistry"))
