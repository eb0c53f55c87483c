"""Bottleneck reports: per run (`write_report`) and per Hydra multirun
(`pipeline.report.sweep.SweepSummary`). docs/report.md describes both."""
from pipeline.report.analysis import Analysis, analyse
from pipeline.report.build import ReportPaths, write_report

__all__ = ["Analysis", "ReportPaths", "analyse", "write_report"]
