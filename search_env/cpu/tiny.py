"""Deprecated name of ``search_demo.tiny`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.tiny", __name__ == "__main__")
