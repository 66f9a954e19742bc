"""Reading results: loading, checkpoint selection, tables, figures and the report (docs/report.md)."""
