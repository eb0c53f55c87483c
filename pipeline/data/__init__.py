"""Data: the stage DAG built from config and validated (graph.py), its
execution on Dask one batch task at a time (executor.py) with the worker's
hand-off of finished arrays through shared memory (handoff.py), and the
dataset a run reads or generates (dataset.py, synthetic.py).

May import: `stages`, the scheduler's types. Never delivery, training or anything above.
"""
