"""Deprecated name of ``cpu_engine.local_rollout`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "cpu_engine.local_rollout", __name__ == "__main__")
