"""Pure logic, checked in this process: config rules, shapes, planner pieces, retention, error kinds, lint and
architecture contracts. Fast: no training process is started."""
