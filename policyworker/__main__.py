"""`python -m policyworker demo | info | bench` (also what `torchrun -m policyworker` runs)."""

import sys

from policyworker.cli import main

if __name__ == "__main__":
    sys.exit(main())
