"""Dashboards: render the step records written by :class:`~lightning_hydra.BubbleMonitor` as HTML and PNGs."""

from lightning_hydra.report.dashboard import SUMMARY_LEGEND, find_runs, load_run, render_report, summary_table

__all__ = ["SUMMARY_LEGEND", "find_runs", "load_run", "render_report", "summary_table"]
