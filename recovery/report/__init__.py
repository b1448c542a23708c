"""Postmortems from the log: the incident report (`fold`), its terminal and HTML renderings (`terminal`, `html`),
what-if replays under other policies (`whatif`) and the diff of two logs' decisions (`diff`). A layer above the
simulator (what-if replays run it) and below the command line."""

from recovery.report.fold import REPORT_VERSION, ReportFold, build_report
from recovery.report.source import iter_file

__all__ = ["REPORT_VERSION", "ReportFold", "build_report", "iter_file"]
