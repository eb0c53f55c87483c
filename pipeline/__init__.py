"""Ensemble training from one shared preprocessing pipeline.

The folders are the layers, bottom first: `runtime` (how processes live,
wait and end; the user's error), the stage contract (`stages/`, beside
this package), `scheduler` (pure FLEET logic), `data` (stage DAG on Dask),
`delivery` (topologies, hubs, rings, collectives), `training` (trainers, models, rate measurement), `measure`
(the run recorder), `orchestration` (driver, flotillas, node agents,
devices), `report` (reports, mode=profile). The entry sits on top:
`__main__.py` (the command), `config.py` (schema), `run.py` (one run wired
together), `callbacks.py` (Hydra), `node.py` (the node agent's command),
`predict.py` (a finished run's ensemble used on any files: load_ensemble,
`python -m pipeline.predict`).
A layer imports only the layers under it (docs/architecture.md).
"""
