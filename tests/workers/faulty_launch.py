"""recipes.launch whose ranks run tests/workers/faulty_step_worker.py: its faults under torchrun's elastic agent."""

from __future__ import annotations

import sys

from recipes.launch import main

if __name__ == "__main__":
    sys.exit(main(entry="tests.workers.faulty_step_worker"))
