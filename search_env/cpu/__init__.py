"""Deprecated: the CPU engine is ``cpu_engine`` and the demo ``search_demo``; the modules here
keep the old names working (``search_env.moved``)."""
