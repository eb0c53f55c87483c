"""Orchestration: carrying the scheduler's decisions out on real processes.
The driver (driver.py, a thread per flotilla), a flotilla laid out over its
nodes (flotilla.py), one node's processes and the agent serving them on a
real host (node.py), device slots and the memory check (devices.py).

May import: the scheduler, measure, training, delivery, data, `stages`.
Never reports or the entry (pipeline/*.py).
"""
