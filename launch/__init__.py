"""The launchers: one training run (``python -m launch run``, wrapped by launch/run.sh), the
evaluation of a run's checkpoints (``python -m launch eval``, launch/eval.sh), fetching what the
GPU recipes need (``python -m launch prepare``, launch/prepare.sh), the retriever a recipe describes
(``python -m launch retriever``, launch/serve_retriever.sh), and their parts: the preflight's run
setup, the resume check, the retriever a launcher starts and watches.

Not an installed package: run it from the repository (the shell wrappers put it on the path).
"""
