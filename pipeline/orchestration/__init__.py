"""Orchestration: carrying the scheduler's decisions out on real processes.
The driver (driver.py, a thread per flotilla), a flotilla laid out over its
nodes (flotilla.py), one node's processes and the agent serving them on a
real host (agent.py; link.py its connections), device slots (devices.py),
and the run's slot groups, planned and checked against a slot's memory
(group_plan.py).

May import: the scheduler, measure, training, delivery, data, `stages`.
Never reports or the entry (pipeline/*.py).
"""
