"""Reports: what a run measured, told to people. The bottleneck report per
run (`write_report`: analysis.py, build.py, plots.py), the summary tables
(summary.py), the sweep summary per Hydra multirun (sweep.py), and
`mode=profile`, a short profiling pass whose only product is that report
(profile_run.py). docs/report.md describes them.

May import: orchestration (device resolution), measure, training, delivery,
data, the scheduler, `stages`. Never the entry (pipeline/*.py).
"""
from pipeline.report.analysis import Analysis, analyse
from pipeline.report.build import ReportPaths, write_report

__all__ = ["Analysis", "ReportPaths", "analyse", "write_report"]
