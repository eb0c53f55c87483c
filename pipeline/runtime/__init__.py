"""Runtime: how a run's processes live and wait, whatever layer they serve:
stop requests and a parent's death (lifetime.py: Ctrl-C and SIGTERM in the
driver, quiet children that exit with their parent, stale shared memory
removed), waits that never hang silently (hang.py: HangError, patience), and
files written whole or not at all (files.py).

May import: nothing of the project (every layer above the scheduler uses it).
"""
