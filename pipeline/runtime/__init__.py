"""Runtime: how a run's processes live and wait, whatever layer they serve:
stop requests and a parent's death (lifetime.py: Ctrl-C and SIGTERM in the
driver, quiet children that exit with their parent, stale shared memory
removed), waits that never hang silently (hang.py: HangError, patience),
files written whole or not at all (files.py), and the user's mistakes
(errors.py: `UserError`, one message and exit code 2).

May import: nothing of the project (it is the bottom layer: every other uses it).
"""
