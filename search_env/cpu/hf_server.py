"""Deprecated name of ``cpu_engine.hf_server`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "cpu_engine.hf_server", __name__ == "__main__")
