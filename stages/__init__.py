"""Stages: read, decode, cache, augment, broadcast, one small file each, over
the contract in base.py (`Stage`, `Spec`, `BatchContext`).

May import: `pipeline.runtime` (a stage's mistakes are `UserError`s) and
nothing else of the project: no Dask, no torch.
"""
