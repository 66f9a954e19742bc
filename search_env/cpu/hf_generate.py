"""Deprecated name of ``cpu_engine.hf_generate`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "cpu_engine.hf_generate", __name__ == "__main__")
