"""Training: the trainer process (one per slot: normalise on device, SGD
step, validate, checkpoint; trainer.py), its typed reports (reports.py),
the models (models.py) and the measurement of training rates by short real
runs (rates.py).

May import: delivery (the reading end of a ring, process-group rendezvous),
data, the scheduler's types, `stages`. Never Dask directly, never anything above.
"""
