"""The report stage: paper-shaped tables with confidence intervals and significance
markers, figures, and ``reports/report.md`` (``build.build_report``)."""
