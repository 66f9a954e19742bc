"""Checkpoint evaluation in two lifecycles: ``eval.run`` produces results (``python -m eval run``),
``eval.report`` reads them (selection, tables, figures, the report); ``eval.stats`` serves both."""
