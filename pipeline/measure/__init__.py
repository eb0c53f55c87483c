"""Measurement: the run recorder (recorder.py) that folds what batch tasks,
hubs and trainers report into results.json's figures, and the objective
(objective.py) a run returns to a Hydra sweeper, read from those figures,
and tracking (tracking.py): each member's epochs where tracking tools read
them.

May import: training (reports, model specs), delivery, data, `stages`. Never
orchestration or reports.
"""
